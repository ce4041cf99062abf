"""``python -m benchmarks.autoscale``: the W4 benchmark (see :mod:`benchmarks.autoscale`)."""

from benchmarks.autoscale.run import main

if __name__ == "__main__":
    raise SystemExit(main())
