"""What must happen before PyTorch is imported, in the package's first import.

`diloco serve` run as a command puts PyTorch's tensors of 2 MB or more in transparent huge pages
(`THP_MEM_ALLOC_ENABLE=1`, unless the environment says otherwise), so the blocks the server maps
and hands back when freed (runtime/server/heap.py) fault in 2 MB at a time, not 4 KB: 20m fp4 ×
64 workers took 0.23 CPU s per push with it, 0.31 without (results/server_capacity_map_large.json).
PyTorch reads the variable once, at its first allocation, so the server cannot set it later. A
library user's process, and every other command, is left as it is.
"""

import os
import sys

_command = sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0] if sys.argv else "") == "diloco"
if _command and sys.argv[1:2] == ["serve"] and "torch" not in sys.modules:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
