"""megatron-core 0.16.1's Muon (megatron/core/optimizer/muon.py: TensorParallelMuon and its builder
get_megatron_muon_optimizer) on emerging-optimizers 0.3.0, the oracle of tests/test_muon.py.

emerging-optimizers needs Python >= 3.12 (it imports typing.override) and .venv runs 3.11, so
`make setup` installs its pure-Python wheel apart, under .oracle/emerging-optimizers, and this
module puts that on sys.path with typing.override as the identity. The only release on the
package indexes, 0.3.0, renamed two keywords that megatron-core 0.16.1 passes (the optimizer's
use_nesterov is now nesterov, newton_schulz_tp's mode is now tp_mode, as Megatron-LM's main branch
spells them): `load` renames them on the way in, nothing else; and emerging-optimizers' Triton
kernel module (CUDA only) is left out. The math is emerging-optimizers'.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

import pytest

EMERGING_OPTIMIZERS = Path(__file__).resolve().parent.parent / ".oracle" / "emerging-optimizers"


def load():
    """megatron.core.optimizer.muon with HAVE_EMERGING_OPTIMIZERS True; skips where it cannot be had."""
    pytest.importorskip("megatron.core", reason='megatron-core (the oracle) is missing: pip install -e ".[dev]"')
    if not EMERGING_OPTIMIZERS.is_dir():
        pytest.skip(f"emerging-optimizers is missing under {EMERGING_OPTIMIZERS}: run make setup")
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # Python 3.12's decorator, a marker only
    if str(EMERGING_OPTIMIZERS) not in sys.path:
        sys.path.insert(0, str(EMERGING_OPTIMIZERS))
    # its Triton SYRK kernel (--muon-use-syrk, CUDA only) imports triton, which CPU torch lacks:
    # an empty kernels module that says it has none (the oracle runs without the kernel)
    sys.modules.setdefault("emerging_optimizers.triton_kernels", types.SimpleNamespace(HAS_TRITON_340=False))
    import emerging_optimizers.orthogonalized_optimizers as eo
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    if not getattr(eo, "_renamed_for_megatron_0_16", False):
        base, newton_schulz_tp = eo.OrthogonalizedOptimizer, muon_utils.newton_schulz_tp

        class OrthogonalizedOptimizer(base):
            def __init__(self, *args, use_nesterov=None, **kwargs):
                super().__init__(*args, **kwargs, **({} if use_nesterov is None else {"nesterov": use_nesterov}))

        def renamed_newton_schulz_tp(*args, mode=None, **kwargs):
            return newton_schulz_tp(*args, **kwargs, **({} if mode is None else {"tp_mode": mode}))

        eo.OrthogonalizedOptimizer, muon_utils.newton_schulz_tp = OrthogonalizedOptimizer, renamed_newton_schulz_tp
        eo._renamed_for_megatron_0_16 = True
    from megatron.core.optimizer import muon

    assert muon.HAVE_EMERGING_OPTIMIZERS, "megatron-core did not import emerging-optimizers"
    return muon
