"""What the tests, the benchmarks and the chapters use to check a kernel against an independent reference.

    relative_error(got, reference)                 max |got - reference| / max |reference|, in float64
    finite_difference_gradient(loss, array, h)     d loss / d array by central differences, in place
    assert_within_summation_bound(got, terms, start)
                                                   a float32 sum against the rounding bound of any order
    torch_or_none()                                PyTorch if it imports, else None (the comparisons skip)
    draw_graph(nodes, edges, title)                a computation graph, forward values and gradients on its edges

Arrays may come from either backend: they are copied to numpy (float64) before any arithmetic.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np

from gpt2_cupy import backend

FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def _float64(array):
    if isinstance(array, backend.xp.ndarray):
        array = backend.asnumpy(array)  # a copy from the GPU; on the CPU the array itself
    return np.asarray(array, dtype=np.float64)


def relative_error(got, reference):
    """max |got - reference| / max |reference|: one number for a whole array, blind to near-zero entries.

    A reference of all zeros gives the largest absolute difference instead (a ratio to 0 says nothing).
    NaN anywhere in got gives NaN, which fails every `error < tolerance` check.
    """
    got, reference = _float64(got), _float64(reference)
    if got.shape != reference.shape:
        raise ValueError(f"relative_error: got has shape {got.shape}, reference {reference.shape}")
    if got.size == 0:
        return 0.0
    difference = np.abs(got - reference).max()
    scale = np.abs(reference).max()
    return float(difference / scale) if scale > 0 else float(difference)


def finite_difference_gradient(loss, array, h=1e-6):
    """d loss() / d array by central differences, changing one entry of `array` (float64) at a time in place.

    loss takes no argument and reads `array` itself; its error is O(h²) plus rounding of order 1e-16 / h.
    """
    if array.dtype != np.float64:
        raise TypeError(f"finite_difference_gradient: array has dtype {array.dtype}; use float64 "
                        "(in float32 the rounding of loss() swamps the difference)")
    gradient = np.zeros_like(array)
    for index in np.ndindex(array.shape):
        saved = array[index]
        array[index] = saved + h
        loss_plus = loss()
        array[index] = saved - h
        loss_minus = loss()
        array[index] = saved
        gradient[index] = (loss_plus - loss_minus) / (2 * h)
    return gradient


def summation_bound(terms, start=0.0, axis=0):
    """The largest rounding error of start + Σ terms along `axis` in float32, whatever the order of additions.

    A sum of n numbers in any order is within γ_n Σ|terms| of the exact sum, γ_n = n u / (1 - n u),
    u = 2⁻²⁴ (Higham, Accuracy and Stability of Numerical Algorithms, §4.2).
    """
    terms64, start64 = _float64(terms), _float64(start)
    count = terms64.shape[axis]  # additions, counting the one into `start`
    gamma = count * FLOAT32_UNIT_ROUNDOFF / (1 - count * FLOAT32_UNIT_ROUNDOFF)
    return gamma * (np.abs(terms64).sum(axis=axis) + np.abs(start64))


def assert_within_summation_bound(got, terms, start=0.0, axis=0):
    """got (float32) = start + Σ terms along `axis`, within the float32 rounding bound of any summation order."""
    terms64, start64 = _float64(terms), _float64(start)
    bound = summation_bound(terms64, start64, axis)
    error = np.abs(_float64(got) - (start64 + terms64.sum(axis=axis)))
    assert np.all(error <= bound), (f"largest error {error.max():.3g}, "
                                    f"bound there {np.ravel(bound)[error.argmax()]:.3g}")


# One launch of a kernel (out, x, shift) in one block of the threads named: out eight zeros, x = 1 .. 8, both of
# the dtype named, shift an int32; with the dynamic shared memory named.
_ONE_LAUNCH = """
import sys
import numpy as np
from gpt2_cupy import backend
kernel = backend.RawModule(code=sys.argv[1]).get_function(sys.argv[2])
dtype = np.dtype(sys.argv[3])
out, x = backend.xp.zeros(8, dtype=dtype), backend.xp.arange(1, 9, dtype=dtype)
try:
    kernel((1,), (int(sys.argv[5]),), (out, x, np.int32(int(sys.argv[4]))), shared_mem=int(sys.argv[6]))
    backend.synchronize()
    print("ok")
except Exception as error:
    print(type(error).__name__, error)
"""


def launch_in_a_process_of_its_own(code, name, dtype, shift, threads=1, shared_mem=0):
    """What became of one launch of kernel `name` of `code`, taking (out, x, shift) as _ONE_LAUNCH gives them, run
    in a fresh Python process: "ok", or the backend's error, its type and message. A GPU's CUDA context does not
    survive a misaligned access or an illegal address, so a test that makes one on purpose makes it there."""
    result = subprocess.run([sys.executable, "-c", _ONE_LAUNCH, code, name, np.dtype(dtype).name, str(shift),
                             str(threads), str(shared_mem)],
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, timeout=300)
    return result.stdout + result.stderr


def torch_or_none():
    """PyTorch if it is installed and imports, else None: comparisons with it are skipped, not failed."""
    try:
        import torch
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    return torch


def draw_graph(nodes, edges, title, size=(15, 4.6), notes=()):
    """Draw a computation graph: boxes for the nodes, arrows for the edges.

    nodes: {name: (x, y, label)}.
    edges: [(source, target, forward label, backward label, bend)]: each edge carries the value flowing
           forward along it (black, above the arrow) and the gradient flowing back (red, below); bend
           curves the arrow (0 for straight, ±0.3 for a gentle arc).
    notes: [(x, y, text, colour)] placed as they are.
    Labels sit at the middle of their arrow, offset along the arrow's normal, so they never cover it; where
    a label would meet another arrow, bend one of the two edges apart.
    Shows the figure and returns nothing, so that a call as a notebook cell's last line draws it once.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    _, axes = plt.subplots(figsize=size)
    xs = [x for x, _, _ in nodes.values()]
    ys = [y for _, y, _ in nodes.values()]
    axes.set_xlim(min(xs) - 0.9, max(xs) + 0.9)
    axes.set_ylim(min(ys) - 1.7, max(ys) + 0.9)
    axes.set_title(title)
    axes.axis("off")
    for x, y, label in nodes.values():
        axes.text(x, y, label, ha="center", va="center", fontsize=13, zorder=3,
                  bbox=dict(boxstyle="round,pad=0.45", facecolor="#eef3fb", edgecolor="#3b6fb6"))
    to_screen, to_data = axes.transData.transform, axes.transData.inverted().transform
    for source, target, forward, backward, bend in edges:
        (x0, y0, _), (x1, y1, _) = nodes[source], nodes[target]
        axes.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle=f"arc3,rad={bend}", arrowstyle="-|>",
                                       mutation_scale=16, shrinkA=24, shrinkB=24, color="#555", zorder=2))
        # arc3 bends in screen coordinates: the curve's middle is halfway to its control point.
        (sx0, sy0), (sx1, sy1) = to_screen((x0, y0)), to_screen((x1, y1))
        middle = np.array([(sx0 + sx1) / 2 + bend * (sy1 - sy0) / 2, (sy0 + sy1) / 2 - bend * (sx1 - sx0) / 2])
        # The unit normal of the chord, pointing up the screen: forward label on that side, gradient on the other.
        normal = np.array([-(sy1 - sy0), sx1 - sx0])
        normal = normal / (np.linalg.norm(normal) or 1.0)
        if normal[1] < 0:
            normal = -normal
        offset = 12  # pixels
        above, below = to_data(middle + offset * normal), to_data(middle - offset * normal)
        axes.text(*above, forward, ha="center", va="bottom" if normal[1] > 0.5 else "center", fontsize=11)
        axes.text(*below, backward, ha="center", va="top" if normal[1] > 0.5 else "center", fontsize=11,
                  color="#c0392b")
    for x, y, text, colour in notes:
        axes.text(x, y, text, ha="center", va="center", fontsize=12, color=colour)
    plt.show()
