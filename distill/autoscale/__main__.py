"""``python -m distill.autoscale``: the same as ``distill-autoscaler``."""

from distill.autoscale.cli import main

raise SystemExit(main())
