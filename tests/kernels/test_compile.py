"""What Triton compiles the kernels into for Hopper, on the CPU (``tools/compile_hopper.py``, a helper script).

Pruning trusts the shared-memory estimates (``KernelSpec.smem``): one below the compiled size lets a config
through that a ~100 KB part cannot launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from tools.compile_hopper import wgmma_loops


@pytest.mark.slow
def test_compile_smem_estimates_bound_what_triton_compiles_for_hopper():
    # Triton 3.8 stages the "pre"-masked x tile of the shrink in shared memory, where 3.6 and 3.9 feed it from
    # registers; only compiling with the installed Triton shows it. The quick launches here, for sm_90a on the
    # CPU (every launch: `python tools/compile_hopper.py`).
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    root = Path(__file__).resolve().parents[2]
    launches = "shrink_S,shrink_S_drop,shrink_G,reduce_drop,shrink_db,gemm_y"
    out = subprocess.run(
        [sys.executable, "tools/compile_hopper.py", "--launches", launches],
        cwd=root, capture_output=True, text=True, timeout=600, check=True,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},  # compiled, not interpreted
    ).stdout  # fmt: skip
    compiled = [line.split()[0] for line in out.splitlines()[2:] if not line.startswith("CHECK")]
    assert set(compiled) == set(launches.split(",")), out
    assert not [line for line in out.splitlines() if line.startswith("CHECK") and "spills" not in line], out


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_7:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x2f000], R4 ;
        /*0020*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/                   LOP3.LUT R2, R2, R3, RZ, 0x3c, !PT ;
        /*0040*/                   IMAD R4, R4, R5, RZ ;
        /*0050*/                   SHF.R.U32.HI R6, RZ, 0x10, R4 ;
        /*0060*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR10], R24, gsb0 ;
        /*0070*/               @P1 BRA `(.L_x_7) ;
.L_x_8:
        /*0080*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0090*/               @P2 BRA `(.L_x_8) ;
        /*00a0*/                   EXIT ;
"""


def test_compile_wgmma_loops_report_the_integer_work_between_hgmma_issues():
    # One loop issues two HGMMAs with three integer instructions between them (what delays the tensor cores);
    # the other loop issues none and is not reported.
    assert wgmma_loops(SASS) == [{"instructions": 7, "hgmma": 2, "integer": 3, "max_gap": 3}]
