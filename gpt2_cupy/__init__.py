"""gpt2_cupy: GPT-2 trained with CUDA C kernels, run by CuPy on a GPU or by the CPU executor.

With PyTorch's names:

    import gpt2_cupy
    from gpt2_cupy import Tensor, functional as F, nn, optim
    from gpt2_cupy.model import GPT, GPTConfig
    gpt2_cupy.manual_seed(1337)              # dropout's masks and the initial weights
    with gpt2_cupy.no_grad(): ...            # nothing recorded on the tape

Importing the package is cheap: the submodules load, and kernels compile, when first used.
"""

__version__ = "0.1.0"

_FROM_AUTOGRAD = ("Tensor", "Function", "no_grad", "manual_seed", "is_grad_enabled")


def __getattr__(name):
    # Tensor, no_grad, ... are looked up here on first use (PEP 562), so `import gpt2_cupy` does not pick a
    # backend; `from gpt2_cupy import nn, optim, functional` imports those submodules the usual way.
    if name in _FROM_AUTOGRAD:
        from gpt2_cupy import autograd

        return getattr(autograd, name)
    raise AttributeError(f"module 'gpt2_cupy' has no attribute {name!r}")
