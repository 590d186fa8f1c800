"""Our declarations of libibverbs' ABI (``native/verbs_abi.h``, what the verbs module and the
test double are built with) against rdma-core's own ``<infiniband/verbs.h>``: every struct
size and alignment, field offset and constant they use must be the same.

The real header is taken from ``MOONCAKE_VERBS_HEADERS`` (an include directory holding
``infiniband/verbs.h``, e.g. libibverbs-dev unpacked with ``dpkg -x``: what ``.ci/run``
does, so that the package itself is built without it), else from /usr/include.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from helpers import skip_or_fail

HERE = Path(__file__).parent
NATIVE = HERE.parent.parent / "native"
CHECK = HERE / "verbs_abi_check.c"


def real_include() -> str:
    include = os.environ.get("MOONCAKE_VERBS_HEADERS") or "/usr/include"
    if not Path(include, "infiniband", "verbs.h").is_file():
        skip_or_fail(f"rdma-core's infiniband/verbs.h is not under {include} (apt install "
                     "libibverbs-dev, or set MOONCAKE_VERBS_HEADERS to an include directory "
                     "holding it)")
    return include


def facts(tmp: Path, name: str, header: str, include: str) -> dict[str, int]:
    """Compile the check against ``header`` (found under ``include``) and run it."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        skip_or_fail(f"no C compiler ({cc})")
    exe = tmp / name
    built = subprocess.run([cc, "-std=gnu11", "-Wall", "-Werror", f"-DVERBS_HEADER={header}",
                            f"-I{include}", "-o", str(exe), str(CHECK)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {key: int(value) for key, _, value in (line.rpartition(" ")
                                                  for line in out.splitlines())}


def test_our_verbs_declarations_match_rdma_cores(tmp_path):
    include = real_include()
    ours = facts(tmp_path, "ours", '"verbs_abi.h"', str(NATIVE))
    theirs = facts(tmp_path, "theirs", "<infiniband/verbs.h>", include)
    assert ours.keys() == theirs.keys() and len(ours) > 200
    differ = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert not differ, f"verbs_abi.h differs from {include}/infiniband/verbs.h " \
                       f"(ours, theirs): {differ}"
