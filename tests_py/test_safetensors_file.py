"""SafetensorsFile (plain reads, no memory map) against the safetensors package: every tensor, every dtype,
parts along each dimension, and clear errors for files that are not safetensors."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.models.safetensors_file import SafetensorsFile


@pytest.fixture()
def tensors_file(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 5, generator=generator),
        "bf16": torch.randn(33, 64, generator=generator).to(torch.bfloat16),
        "f16_3d": torch.randn(3, 4, 6, generator=generator).to(torch.float16),
        "i64": torch.arange(10),
        "u8": torch.arange(12, dtype=torch.uint8).view(3, 4),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def test_every_tensor_matches_the_safetensors_package(tensors_file):
    path, tensors = tensors_file
    with SafetensorsFile(path) as ours, safe_open(str(path), framework="pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys()) == sorted(tensors)
        for name in tensors:
            got, expected = ours.get_tensor(name), theirs.get_tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected), name
            assert ours.shape(name) == list(expected.shape) and ours.dtype(name) == expected.dtype


@pytest.mark.parametrize("name,dim,start,length", [("bf16", 0, 5, 9), ("bf16", 1, 16, 32), ("f32", 1, 4, 1),
                                                   ("f16_3d", 1, 1, 2), ("f16_3d", 2, 0, 3), ("f16_3d", 0, 2, 1),
                                                   ("i64", 0, 3, 0)])
def test_parts_read_alone_equal_slices_of_the_whole(tensors_file, name, dim, start, length):
    path, tensors = tensors_file
    with SafetensorsFile(path) as ours:
        index = (slice(None),) * dim + (slice(start, start + length),)
        assert torch.equal(ours.get_part(name, dim, start, length), tensors[name][index])


def test_not_a_safetensors_file_is_named(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsFile(bad)
    bad.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="too short"):
        SafetensorsFile(bad)


def test_truncated_file_is_named(tensors_file, tmp_path):
    path, _ = tensors_file
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-64])
    with SafetensorsFile(cut) as ours:
        with pytest.raises(ValueError, match="truncated"):
            for name in ours.keys():
                ours.get_tensor(name)
