"""examples/ddp_to_diloco.py: the data-parallel script turned into DiLoCo runs under torchrun,
as two workers of two ranks (DDP inside each) and as the plain DDP script, and both train: the
held-out loss ends below a quarter of the untrained model's (computed here, independently)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from harness import BACKEND

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_to_diloco.py")

pytestmark = pytest.mark.usefixtures("backend_importable")


def untrained_loss() -> float:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import ddp_to_diloco as ex
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    x, y = next(ex.batches(4 + 7, 1024, seed=0))
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def torchrun(nprocs: int, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(nprocs), EXAMPLE, "--backend", BACKEND, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError("the example still ran after 240 s, killed:\n" + output[-6000:]) from None
    assert proc.returncode == 0, output[-6000:]
    return output


# Fixed local steps: with steps from measured speed, a loaded machine makes rounds lopsided
# ([92, 7] steps) and the samples trained vary from 7,000 to 95,000 (one CI run ended at 0.44);
# the example's time policy is the default, and tests/train/test_diloco.py covers that policy.
@pytest.mark.parametrize("args", [["--workers", "0,0,1,1", "--samples", "12000", "--local-steps", "fixed"],
                                  ["--plain", "--samples", "12000"]])
def test_the_example_trains_as_diloco_and_as_the_plain_script(args):
    output = torchrun(4, *args)
    loss = float(re.search(r"held-out loss ([0-9.]+)", output).group(1))
    assert loss < 0.25 * untrained_loss(), output[-3000:]
    if "--plain" not in args:
        assert re.search(r"workers \[\[0, 1\], \[2, 3\]\]", output), output[-3000:]
