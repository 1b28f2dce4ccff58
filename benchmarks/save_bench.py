"""Save benchmark: torch.save, dcp.save, dcp.async_save (default and a kept DefaultStager),
flashckpt sync / async / incremental and a raw sequential write, all fsynced, on the same
state; plus host RSS over 40 saves and the GIL probe (persist in threads vs a process).

    python benchmarks/save_bench.py --size-gb 1.2 --out bench.json [--dir DIR] [--gpu]

Same code as ``flashckpt bench --parts save,rss,gil``; prints a markdown table with PASS/FAIL per
target and writes JSON.
"""

from __future__ import annotations

import sys

from flashckpt.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--parts", "save,rss,gil", *sys.argv[1:]]))
