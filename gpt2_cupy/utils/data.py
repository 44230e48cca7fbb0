"""torch.utils.data: Dataset, TensorDataset, DataLoader, RandomSampler, SequentialSampler, random_split.

A DataLoader draws indices from its sampler, fetches dataset[i] for each and collates a batch: tensors are
stacked along a new first axis, numbers become a tensor, tuples and dicts are collated field by field, as
PyTorch's default_collate. Everything runs in this process (num_workers is accepted and ignored: the
batches are the same, only their fetching is not spread over processes). Shuffling draws from the default
generator, or from generator=.
"""

import math

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.random import host_stream
from gpt2_cupy.tensor_ops import stack


class Dataset:
    """A map-style dataset: __getitem__(i) and __len__."""

    def __getitem__(self, index):
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")


class TensorDataset(Dataset):
    """Item i is (t[i] for each tensor), the tensors of the same first size."""

    def __init__(self, *tensors):
        if any(t.shape[0] != tensors[0].shape[0] for t in tensors):
            raise AssertionError("Size mismatch between tensors")
        self.tensors = tensors

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)

    def __len__(self):
        return self.tensors[0].shape[0]


class Subset(Dataset):
    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, list(indices)

    def __getitem__(self, index):
        return self.dataset[self.indices[index]]

    def __len__(self):
        return len(self.indices)


def random_split(dataset, lengths, generator=None):
    """Subsets of the given lengths (or fractions summing to 1) over a random permutation of the indices."""
    if math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        counts = [int(math.floor(len(dataset) * fraction)) for fraction in lengths]
        for i in range(len(dataset) - sum(counts)):
            counts[i % len(counts)] += 1
        lengths = counts
    if sum(lengths) != len(dataset):
        raise ValueError("Sum of input lengths does not equal the length of the input dataset!")
    order = host_stream(generator).permutation(len(dataset)).tolist()
    starts = numpy.cumsum([0] + list(lengths))
    return [Subset(dataset, order[start:start + length]) for start, length in zip(starts, lengths)]


class SequentialSampler:
    def __init__(self, data_source):
        self.data_source = data_source

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self):
        return len(self.data_source)


class RandomSampler:
    """Indices in a random order (each once), or num_samples of them drawn with replacement."""

    def __init__(self, data_source, replacement=False, num_samples=None, generator=None):
        self.data_source, self.replacement, self.generator = data_source, replacement, generator
        self._num_samples = num_samples
        if not replacement and num_samples is not None and num_samples > len(data_source):
            raise ValueError("num_samples larger than the dataset needs replacement=True")

    @property
    def num_samples(self):
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):
        random, n = host_stream(self.generator), len(self.data_source)
        if self.replacement:
            remaining = self.num_samples
            while remaining > 0:  # in chunks: num_samples may be huge (an endless loader)
                chunk = min(remaining, 32)
                yield from random.integers(0, n, size=chunk).tolist()
                remaining -= chunk
            return
        for _ in range(self.num_samples // n):
            yield from random.permutation(n).tolist()
        yield from random.permutation(n)[:self.num_samples % n].tolist()

    def __len__(self):
        return self.num_samples


def default_collate(batch):
    first = batch[0]
    if isinstance(first, Tensor):
        return stack(batch)
    if isinstance(first, (numpy.ndarray, backend.xp.ndarray)):
        return Tensor(backend.xp.stack([backend.xp.asarray(item) for item in batch]))
    if isinstance(first, bool):
        return Tensor(backend.xp.asarray(numpy.array(batch)))
    if isinstance(first, int):
        return Tensor(backend.xp.asarray(numpy.array(batch, dtype=numpy.int64)))
    if isinstance(first, float):
        return Tensor(backend.xp.asarray(numpy.array(batch, dtype=numpy.float32)))
    if isinstance(first, dict):
        return {key: default_collate([item[key] for item in batch]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(default_collate(list(field)) for field in zip(*batch)) if isinstance(first, tuple) \
            else [default_collate(list(field)) for field in zip(*batch)]
    return batch


class DataLoader:
    """Batches of dataset[i], the indices from sampler (RandomSampler when shuffle, else in order)."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None, num_workers=0,
                 collate_fn=None, pin_memory=False, drop_last=False, timeout=0, worker_init_fn=None,
                 generator=None, **options):
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.sampler = sampler if sampler is not None else (
            RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset))
        self.batch_sampler = batch_sampler
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.num_workers, self.pin_memory = num_workers, pin_memory

    def _batches_of_indices(self):
        if self.batch_sampler is not None:
            yield from self.batch_sampler
            return
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __iter__(self):
        for indices in self._batches_of_indices():
            yield self.collate_fn([self.dataset[i] for i in indices])

    def __len__(self):
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        count = len(self.sampler)
        return count // self.batch_size if self.drop_last else -(-count // self.batch_size)
