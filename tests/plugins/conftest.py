"""Plugins tests: run the Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET is read when a kernel is decorated (at import of qkiln.plugins.triton_*), so it
must be set before those modules are imported; nothing imports them at collection time.

triton 3.6's interpreter converts loop bounds with int(array of shape (1,)), which numpy >= 2.4
rejects ("only 0-dimensional arrays can be converted to Python scalars"; triton-lang/triton#9171,
fixed upstream after 3.6). Until the pinned triton has the fix, tests patch that one conversion.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter

    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _patch_with_scalar_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_with_scalar_index


@pytest.fixture(scope="module")
def native_ext():
    """qkiln's compiled CPU kernels (plugins/cpu_native.py), or a skip saying why not."""
    from qkiln.plugins import cpu_native

    module = cpu_native.native_extension()
    if module is None:
        pytest.skip("native CPU extension did not build (see the stderr line from cpu_native)")
    return module
