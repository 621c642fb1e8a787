"""The data loader's tokens/s alone, against the training tokens/s of a model it feeds.

Builds (or reuses) the token store of a source, then measures
1. tokenizing into the store once (a fresh cache; skipped with --no-build),
2. the loader alone: ``LMBatches[step]`` for many random steps (shuffled windows spread over
   the whole memory-mapped store), in line and through Keras' prefetching ``PyDataset``
   threads (what ``fit`` iterates),
3. training: ``train_on_batch`` of the model on the loader's batches, one device, float32,
and prints the ratio loader / training: how many times faster the input is than its consumer.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/loader_throughput.py \\
        --preset gpt2-small --sequence-length 512 --batch 2 --out loader.json
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import kdist  # before jax: it selects Keras' JAX backend

# isort: split
import keras
import numpy as np
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter


def loader_tokens_per_second(dataset, steps: int, prefetch: bool) -> float:
    tokens = 0
    if prefetch:
        batches = PyDatasetAdapter(dataset, shuffle=False).get_numpy_iterator()
        next(batches)  # start the threads
        start = time.perf_counter()
        for _ in range(steps):
            x, _ = next(batches)
            tokens += x.size
    else:
        rng = np.random.default_rng(0)
        order = rng.integers(0, 10 * dataset.num_windows, steps)  # any step, any epoch
        start = time.perf_counter()
        for step in order:
            x, _ = dataset[int(step)]
            tokens += x.size
    return tokens / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="python-stdlib")
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--vocabulary-size", type=int, default=8192)
    p.add_argument("--sequence-length", type=int, default=512)
    p.add_argument("--batch", type=int, default=2, help="global batch for training")
    p.add_argument("--loader-batch", type=int, default=8, help="batch for the loader alone")
    p.add_argument("--loader-steps", type=int, default=2000)
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument("--no-build", action="store_true", help="reuse the cache; do not time it")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()

    result = dict(vars(args))
    if not args.no_build:  # tokenizer training + tokenizing, into a fresh cache
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            data = kdist.data.lm_dataset(args.data, args.sequence_length, args.loader_batch,
                                         args.vocabulary_size, cache_dir=cache)
            result["build_seconds"] = time.perf_counter() - start
            stores = [*Path(cache).glob("tokens-*.npy")]
            result["store_mib"] = sum(s.stat().st_size for s in stores) / 2**20
    kw = dict(sequence_length=args.sequence_length, vocabulary_size=args.vocabulary_size)
    data = kdist.data.lm_dataset(args.data, global_batch_size=args.loader_batch, **kw)
    result["train_tokens"] = data.train_tokens
    result["loader_tokens_per_s"] = loader_tokens_per_second(
        data.train, args.loader_steps, prefetch=False)
    result["prefetched_loader_tokens_per_s"] = loader_tokens_per_second(
        data.train, args.loader_steps, prefetch=True)

    train = kdist.data.lm_dataset(args.data, global_batch_size=args.batch, **kw).train
    model = kdist.models.GPTCausalLM.from_preset(args.preset, vocabulary_size=data.vocabulary_size)
    model.compile(optimizer=kdist.optim.adamw())
    result["parameters"] = model.count_params()
    float(model.train_on_batch(*train[0]))  # compile
    times = []
    for step in range(1, 1 + args.train_steps):
        x, y = train[step]
        start = time.perf_counter()
        float(model.train_on_batch(x, y))  # float() waits for the step
        times.append(time.perf_counter() - start)
    result["train_step_s"] = statistics.median(times)
    result["train_tokens_per_s"] = args.batch * args.sequence_length / result["train_step_s"]
    result["ratio"] = result["loader_tokens_per_s"] / result["train_tokens_per_s"]

    print(f"source {args.data}: {data.train_tokens:,} training tokens")
    if "build_seconds" in result:
        print(f"tokenizer + token store, built once: {result['build_seconds']:.1f} s "
              f"({result['store_mib']:.1f} MiB)")
    print(f"loader alone (batch {args.loader_batch} x {args.sequence_length}, random steps): "
          f"{result['loader_tokens_per_s']:,.0f} tokens/s; through the prefetching PyDataset: "
          f"{result['prefetched_loader_tokens_per_s']:,.0f} tokens/s")
    print(f"training {args.preset} ({result['parameters']:,} parameters, batch {args.batch} x "
          f"{args.sequence_length}, 1 device, float32): {result['train_step_s']:.2f} s/step, "
          f"{result['train_tokens_per_s']:,.0f} tokens/s")
    print(f"ratio loader / training: {result['ratio']:,.0f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    keras.config.set_dtype_policy("float32")
    main()
