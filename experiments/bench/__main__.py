"""``make bench``: every benchmark of the project, each measured side by side in one run."""

import importlib

# Each module prints its own tables, measured in this one run.
BENCHMARKS = (
    "moe_layer",
    "dispatch_bytes",
    "ep_topology",
    "cp_attention",
    "pipeline_bubble",
    "meta_init",
    "activation_memory",
    "ep_overlap",
    "ep_folding",
    "peak_memory",
    "pipeline_gather",
    "data_loading",
    "cp_documents",
    "checkpoint_save",
    "muon",
    "health_cost",
)


def main() -> None:
    for name in BENCHMARKS:
        importlib.import_module(f"experiments.bench.{name}").main()
        print()


if __name__ == "__main__":
    main()
