"""`python -m slimtune.flows JOB_DIR`: one torchrun rank of a multi-GPU run (`slimtune.flows.ranks.main`).

An entry of its own: `-m slimtune.flows.ranks` would import that module twice (once through the package,
whose flow imports it, and once as __main__), which runpy warns about.
"""

import sys

from slimtune.flows.ranks import main

sys.exit(main())
