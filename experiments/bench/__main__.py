"""``make bench``: every benchmark of the project, each measured side by side in one run."""

from experiments.bench import dispatch_bytes, moe_layer


def main() -> None:
    moe_layer.main()
    print()
    dispatch_bytes.main()


if __name__ == "__main__":
    main()
