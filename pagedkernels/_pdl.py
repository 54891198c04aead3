"""The device side of programmatic dependent launch (``_backend.programmatic_dependent_launch``): what a kernel
launched with it runs before it reads anything the kernel ahead of it wrote. A function of its own so the Triton
interpreter, which has no griddepcontrol, can run those kernels with it stood in for (tests/pagedkernels/test_pdl.py)."""

import triton
import triton.language as tl


@triton.jit
def pdl_wait():
    """Wait until the kernel ahead has finished and its writes are visible (griddepcontrol.wait), then let the kernel
    after this one launch (griddepcontrol.launch_dependents: it waits the same way before reading our outputs)."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
