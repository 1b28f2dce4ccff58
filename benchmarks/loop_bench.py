"""Training-loop benchmark: step time of the demo GPT with no checkpoints vs a checkpoint
every k steps with torch.save (sync), dcp.async_save and flashckpt async (optimizer hook).

    python benchmarks/loop_bench.py --out loop.json [--gpu]

Same code as ``flashckpt bench --parts loop``.
"""

from __future__ import annotations

import sys

from flashckpt.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--parts", "loop", *sys.argv[1:]]))
