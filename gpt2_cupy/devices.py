"""torch.device: a name for where tensors live. One backend runs everything here (a GPU through CuPy or
the CPU executor), so "cuda", "cpu" and "mps" all name it: model.to(device) and tensor.to(device) move
nothing, and code that picks a device by what is available runs unchanged on either machine. A tensor's
own .device says which backend that is."""


class device:  # noqa: N801  (torch's name)
    """device("cuda"), device("cuda:0"), device("cpu"), device("cuda", 0); .type and .index as torch's."""

    def __init__(self, type, index=None):  # noqa: A002  (torch's argument names)
        if isinstance(type, device):
            type, index = type.type, type.index
        if isinstance(type, int):
            type, index = "cuda", type
        kind, _, number = str(type).partition(":")
        if number:
            if index is not None:
                raise RuntimeError("type (string) must not include an index because index was passed explicitly: "
                                   f"{type}")
            index = int(number)
        if kind not in ("cpu", "cuda", "mps", "meta"):
            raise RuntimeError(f"Expected one of cpu, cuda, mps, meta device type at start of device string: {type}")
        self.type, self.index = kind, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self):
        return f"device(type='{self.type}'" + ("" if self.index is None else f", index={self.index}") + ")"

    def __eq__(self, other):
        if isinstance(other, str):
            kind, _, number = other.partition(":")
            return (self.type, self.index) == (kind, int(number) if number.isdigit() else None)
        return isinstance(other, device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))
