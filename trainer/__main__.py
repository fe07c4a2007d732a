"""`python -m trainer`: see trainer/train.py."""

import sys

from trainer.train import main

sys.exit(main())
