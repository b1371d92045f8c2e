"""scripts/model_wheel_halves.sh: the default model's wheel split here, carried one half a call to a GPU
machine and joined there by gpu_check.sh. The joined file must be the wheel byte for byte, and halves that
do not make it must be refused."""

import hashlib
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "model_wheel_halves.sh"


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def _make_wheel(tmp_path: Path, size: int) -> Path:
    wheel = tmp_path / "src" / "llm_fake-0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(os.urandom(size))
    return wheel


def _carry(repo: Path, half: int, device_repo: Path) -> None:
    """What one call carries: this half's folder only."""
    for i in (1, 2):
        dst = device_repo / f".model_wheel_{i}"
        if dst.exists():
            for f in dst.iterdir():
                f.unlink()
            dst.rmdir()
    src, dst = repo / f".model_wheel_{half}", device_repo / f".model_wheel_{half}"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())


def test_the_halves_join_into_the_wheel_over_two_calls(tmp_path):
    repo, device_repo, target = tmp_path / "repo", tmp_path / "device", tmp_path / "root_smollm2"
    repo.mkdir()
    device_repo.mkdir()
    wheel = _make_wheel(tmp_path, 1_000_003)  # odd: the halves differ by a byte
    split = _run(repo, "split", str(wheel))
    assert split.returncode == 0, split.stderr
    sizes = [(repo / f".model_wheel_{i}" / "part").stat().st_size for i in (1, 2)]
    assert sum(sizes) == 1_000_003 and max(sizes) - min(sizes) <= 1

    _carry(repo, 1, device_repo)
    first = _run(device_repo, "join", str(target))
    assert first.returncode == 0, first.stderr
    assert not (target / wheel.name).exists()  # one half is not a wheel yet

    _carry(repo, 2, device_repo)
    second = _run(device_repo, "join", str(target))
    assert second.returncode == 0, second.stderr
    joined = target / wheel.name
    assert hashlib.sha256(joined.read_bytes()).digest() == hashlib.sha256(wheel.read_bytes()).digest()


def test_halves_of_another_wheel_are_refused(tmp_path):
    repo, device_repo, target = tmp_path / "repo", tmp_path / "device", tmp_path / "root_smollm2"
    repo.mkdir()
    device_repo.mkdir()
    wheel = _make_wheel(tmp_path, 4096)
    assert _run(repo, "split", str(wheel)).returncode == 0
    _carry(repo, 1, device_repo)
    assert _run(device_repo, "join", str(target)).returncode == 0
    # The second half of a different split (the wheel changed in between) must not be joined.
    wheel.write_bytes(os.urandom(4096))
    assert _run(repo, "split", str(wheel)).returncode == 0
    _carry(repo, 2, device_repo)
    joined = _run(device_repo, "join", str(target))
    assert joined.returncode == 1
    assert "SHA-256 differs" in joined.stderr
    assert not any(target.glob("*.whl*"))
