"""The main job (README: `make run`). For now: the environment and the configuration in force.

The HF integration turns this into a generate() demo with and without oxygen_torch.
"""

import sys

from oxygen_torch.cli import doctor

if __name__ == "__main__":
    sys.exit(doctor())
