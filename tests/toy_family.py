"""A model family defined only in the tests — a two-layer MLP language model — to show
that kdist's parallel layer, planner and Throughput callback use a family's declarations
(logical axes, step features, cost model), never its class. tests/models/test_toy_family.py
tests it; tests/parallel/harness.py registers it as the ``toy`` family."""

import keras
from keras import ops

from kdist.flops import FlopsPerToken
from kdist.models.base import Backbone, Task
from kdist.models.cost import CostModel
from kdist.parallel.rules import add_weight, build_with_axes

VOCAB, HIDDEN, MLP, LENGTH = 256, 64, 128, 16


class MLPBackbone(Backbone, keras.Model):
    """Token embedding, then one residual MLP (up, GELU, down); no attention."""

    def __init__(self, vocabulary_size: int, hidden_dim: int, mlp_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size, self.hidden_dim, self.mlp_dim = vocabulary_size, hidden_dim, mlp_dim
        self.up = keras.layers.Dense(mlp_dim, activation="gelu", name="up")
        self.down = keras.layers.Dense(hidden_dim, name="down")

    def build(self, input_shape):
        self.embeddings = add_weight(self, "embeddings", (self.vocabulary_size, self.hidden_dim),
                                     ("vocab", "embed"),
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))
        hidden = (*input_shape, self.hidden_dim)
        build_with_axes(self.up, hidden, kernel=("embed", "mlp"), bias=("mlp",))
        build_with_axes(self.down, (*input_shape, self.mlp_dim), kernel=("mlp", "embed"),
                        bias=("embed",))

    def call(self, token_ids):
        x = ops.take(self.embeddings, token_ids, axis=0)  # (B, T, D)
        return x + self.down(self.up(x))                  # (B, T, D)


class MLPCost(CostModel):
    def __init__(self, vocabulary_size, hidden_dim, mlp_dim, **_):
        self.v, self.d, self.f = vocabulary_size, hidden_dim, mlp_dim

    @property
    def parameters(self):
        return self.v * self.d + 2 * self.d * self.f + self.f + self.d

    def flops_per_token(self, sequence_length, causal_half=True):
        # up, down and the tied output projection: 2 FLOPs per multiply-add.
        return FlopsPerToken(qkv=0.0, attention=0.0, output_projection=0.0,
                             mlp=2 * (2 * self.d * self.f), unembedding=2 * self.d * self.v,
                             causal=False, causal_half=causal_half,
                             sequence_length=sequence_length)

    def activation_bytes_per_token(self, sequence_length, bytes_per_value=4, remat=False,
                                   scores_kept=None, logits=True, fused=False):
        return bytes_per_value * (2 * self.d + 2 * self.f + self.v)


class MLPLM(Task, keras.Model):
    backbone_class = MLPBackbone
    token_id_labels = True

    def __init__(self, backbone: MLPBackbone, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone

    def call(self, token_ids):
        hidden = self.backbone(token_ids)                              # (B, T, D)
        return ops.einsum("btd,vd->btv", hidden, self.backbone.embeddings)  # (B, T, V)

    def compile(self, optimizer="adamw", loss=None, **kwargs):
        loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    @classmethod
    def cost_model_for(cls, backbone_config, **task_args):
        return MLPCost(**backbone_config)
