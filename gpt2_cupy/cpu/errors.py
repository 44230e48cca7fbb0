"""What the CPU executor raises. Each message says what went wrong in the learner's terms."""


class CompileError(Exception):
    """The C++ compiler rejected the kernel source; the message is its report, with kernel line numbers."""


class LaunchError(ValueError):
    """A launch a GPU would refuse: too many threads in a block, too much shared memory, an empty grid."""


class KernelNotFoundError(LookupError):
    """No kernel of that name: not in the source, not extern "C", or a template not in name_expressions."""


class KernelError(RuntimeError):
    """The kernel failed while running: a device assert, a bad address, a deadlock between threads."""


class OutOfBoundsError(KernelError):
    """The bounds check caught a read or write outside an array argument."""


class RaceError(KernelError):
    """The race check found outputs that change when the threads run in another order."""
