"""A stand-in child for the background compile that holds until the file named by ``HELD_CHILD_RELEASE``
exists, then compiles as the real child does: a test sees the steps that run while a child still compiles.
(A helper module: ``python -m tests._held_child <job directory>``.)"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from leantrain.compiling import _child


def main(directory: Path) -> None:
    release = Path(os.environ["HELD_CHILD_RELEASE"])
    deadline = time.monotonic() + 600  # a test that never releases does not leave a child behind for long
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    _child.main(directory)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
