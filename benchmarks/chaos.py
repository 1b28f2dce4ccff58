"""Chaos benchmark: goodput under real SIGKILL failures, flashckpt vs torch.save vs dcp.async_save.

    python benchmarks/chaos.py --minutes 30 --mtbf-s 300 --out chaos.json

The same as ``flashckpt chaos`` (see src/flashckpt/demo/chaos.py for the method): each method
trains the demo GPT (about 370 MB of model + AdamW state) for ``--minutes`` of wall time while
the same seeded, exponentially distributed SIGKILLs hit it; each checkpoints at its own
Young/Daly interval. Prints one markdown table (for BENCHMARKS.md) and writes the JSON.
"""

from __future__ import annotations

import sys

from flashckpt.cli import main

if __name__ == "__main__":
    sys.exit(main(["chaos", *sys.argv[1:]]))
