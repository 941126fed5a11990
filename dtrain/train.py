"""`python -m dtrain.train`: the trainer's entry point (`dtrain.engine.train.main`) under the short name the README
gives, so that `torchrun --nproc_per_node=2 -m dtrain.train --profile profiles/ll128.yaml` runs from a checkout and
from an installed wheel alike. `dtrain train` runs the same `main`."""

import sys

from dtrain.engine.train import main

if __name__ == "__main__":
    sys.exit(main())
