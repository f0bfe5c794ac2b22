"""nvme arena failures: each raises its named error naming the tensor key and the path,
and nothing half-written is ever read back."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading

import pytest
import torch
from devices import flip_bits, same_bits
from io_faults import fail_writes

from slcompile.runtime import (
    ArenaClosedError,
    CorruptDataError,
    DiskFullError,
    NvmeArena,
    OffloadDirError,
    OffloadError,
    OffloadFileMissingError,
    ShortReadError,
    Tier,
    TransferEngine,
    TransferFailedError,
    TransferKind,
    UnknownKeyError,
)

NVME, WEIGHT = Tier.NVME, TransferKind.WEIGHT


def assert_names(error: OffloadError, key: str, path: str) -> None:
    assert error.key == key and repr(key) in str(error)
    assert error.path is not None and path in error.path and path in str(error)


def test_arena_file_is_private_and_uses_direct_io(engine):
    engine.wait(engine.store("w", torch.ones(10), NVME, WEIGHT))
    arena = engine.arena
    assert stat.S_IMODE(os.lstat(arena.path).st_mode) == 0o700
    assert os.path.basename(arena.path).startswith(f"slc-offload-{os.getpid()}-")
    assert fcntl.fcntl(arena._fd, fcntl.F_GETFL) & os.O_DIRECT


def test_missing_offload_dir(tmp_path):
    missing = str(tmp_path / "no-parent" / "does-not-exist")  # a missing last folder alone is created
    engine = TransferEngine(offload_dir=missing)
    with pytest.raises(OffloadDirError, match="does not exist, nor does its parent") as caught:
        engine.store("blk0.w", torch.ones(4), NVME, WEIGHT)
    assert_names(caught.value, "blk0.w", missing)


def test_offload_dir_that_is_a_file(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    engine = TransferEngine(offload_dir=str(not_a_dir))
    with pytest.raises(OffloadDirError, match="not a directory") as caught:
        engine.store("blk0.w", torch.ones(4), NVME, WEIGHT)
    assert_names(caught.value, "blk0.w", str(not_a_dir))


def test_unwritable_offload_dir(tmp_path):
    if os.geteuid() == 0:
        # Permission bits do not stop root; sysfs refuses mkdir to everyone.
        unwritable = "/sys/kernel"
        if not os.path.isdir(unwritable):
            pytest.skip("needs /sys/kernel when running as root")
    else:
        unwritable = str(tmp_path / "read-only")
        os.mkdir(unwritable, 0o500)
    engine = TransferEngine(offload_dir=unwritable)
    with pytest.raises(OffloadDirError, match="cannot create a private directory") as caught:
        engine.store("blk0.w", torch.ones(4), NVME, WEIGHT)
    assert_names(caught.value, "blk0.w", unwritable)


def test_capacity_cap_raises_disk_full_and_space_comes_back(tmp_path):
    engine = TransferEngine(offload_dir=str(tmp_path), capacity_bytes=3 * 4096)
    try:
        engine.wait(engine.store("a", torch.zeros(2048), NVME, WEIGHT))  # 2 pages
        with pytest.raises(DiskFullError, match="capacity of 12288 bytes") as caught:
            engine.store("b", torch.zeros(2048), NVME, WEIGHT)
        assert_names(caught.value, "b", engine.arena.file_path)
        assert "b" not in engine
        assert same_bits(engine.wait(engine.load("a")), torch.zeros(2048))
        engine.free("a")
        engine.wait(engine.store("b", torch.ones(2048), NVME, WEIGHT))
        assert same_bits(engine.wait(engine.load("b")), torch.ones(2048))
    finally:
        engine.close()


def test_enospc_when_growing_the_file_is_disk_full(engine, monkeypatch):
    assert engine.arena is not None  # created before the disk "fills up"

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(DiskFullError, match="disk full") as caught:
        engine.store("kv0", torch.zeros(10), NVME, TransferKind.KV)
    assert_names(caught.value, "kv0", engine.arena.file_path)


def test_enospc_during_a_write_fails_the_store_and_its_loads(engine, monkeypatch):
    assert engine.arena is not None  # the arena exists before the I/O is broken
    real_pwritev = os.pwritev
    calls = []

    def full_after_first_chunk(fd, buffers, offset):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", full_after_first_chunk)
    handle = engine.store("act3", torch.ones(3 << 18), NVME, TransferKind.ACTIVATION)  # 3 chunks
    with pytest.raises(DiskFullError) as caught:
        engine.wait(handle)
    assert_names(caught.value, "act3", engine.arena.file_path)
    # Part of the data reached the file, but the slot never became valid.
    with pytest.raises(TransferFailedError, match="last store of this key failed") as caught:
        engine.load("act3")
    assert_names(caught.value, "act3", engine.arena.file_path)
    assert engine.arena.space.used_bytes == 0


def test_load_chained_behind_a_failing_store_fails_too(engine, monkeypatch):
    assert engine.arena is not None  # the arena exists before the I/O is broken
    load_issued = threading.Event()
    fail_writes(monkeypatch, lambda offset: errno.EIO, before=lambda: load_issued.wait(timeout=30))
    store = engine.store("g", torch.ones(1000), NVME, TransferKind.GRADIENT)
    load = engine.load("g")  # issued while the store is still writing
    load_issued.set()
    with pytest.raises(OffloadError, match="write failed"):
        engine.wait(store)
    with pytest.raises(TransferFailedError, match="store this load waited for failed"):
        engine.wait(load)


def test_a_failed_read_names_its_error_and_the_data_reads_back_after(engine, monkeypatch):
    engine.wait(engine.store("r", torch.arange(3000.0), NVME, WEIGHT))

    def broken_preadv(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", broken_preadv)
        with pytest.raises(OffloadError, match="read failed") as caught:
            engine.wait(engine.load("r"))
    assert_names(caught.value, "r", engine.arena.file_path)
    assert same_bits(engine.wait(engine.load("r")), torch.arange(3000.0))


def test_short_read_of_a_truncated_file(engine):
    engine.wait(engine.store("w", torch.ones(5000), NVME, WEIGHT))
    os.truncate(engine.arena.file_path, 4096)
    with pytest.raises(ShortReadError, match="read 4096 of 20000 bytes") as caught:
        engine.wait(engine.load("w"))
    assert_names(caught.value, "w", engine.arena.file_path)


def test_file_removed_underneath(engine):
    engine.wait(engine.store("w", torch.ones(5000), NVME, WEIGHT))
    os.unlink(engine.arena.file_path)
    with pytest.raises(OffloadFileMissingError, match="removed") as caught:
        engine.wait(engine.load("w"))
    assert_names(caught.value, "w", engine.arena.file_path)
    # Found on the I/O thread, before the write: the store's wait raises it.
    with pytest.raises(OffloadFileMissingError) as caught:
        engine.wait(engine.store("w2", torch.ones(10), NVME, WEIGHT))
    assert_names(caught.value, "w2", engine.arena.file_path)


def test_directory_removed_underneath(engine):
    import shutil

    engine.wait(engine.store("w", torch.ones(50), NVME, WEIGHT))
    shutil.rmtree(engine.arena.path)
    with pytest.raises(OffloadFileMissingError) as caught:
        engine.wait(engine.load("w"))
    assert_names(caught.value, "w", engine.arena.path)


def test_a_slot_is_not_readable_before_its_write_completes(tmp_path):
    arena = NvmeArena(str(tmp_path))
    try:
        slot = arena.allocate(100, "half")
        with pytest.raises(OffloadError, match="not completely written"):
            arena.read(slot, 0, 4096, lambda outcome: None)
    finally:
        arena.close()
    assert not os.path.exists(arena.path)


def test_weight_update_that_fails_part_way_leaves_every_weight_as_it_was(engine, monkeypatch):
    from slcompile.runtime.weights import WeightStreamer, update_weights

    streamer = WeightStreamer(engine, NVME, live_blocks=1)
    params = [torch.nn.Parameter(torch.full((1024,), float(i))) for i in range(3)]
    for i, param in enumerate(params):
        streamer.offload(f"w{i}", param)
    writes = []

    def full_after_first_write(offset):
        writes.append(offset)
        return errno.ENOSPC if len(writes) > 1 else None

    fail_writes(monkeypatch, full_after_first_write)
    with pytest.raises(DiskFullError):
        update_weights([(param, torch.full((1024,), 10.0 + i)) for i, param in enumerate(params)])
    monkeypatch.undo()
    # The first new values were written, but under a staging key that never replaced w0.
    assert len(writes) > 1
    assert sorted(engine.keys()) == ["w0", "w1", "w2"]
    for i in range(3):
        assert same_bits(engine.wait(engine.load(f"w{i}")), torch.full((1024,), float(i)))
    update_weights([(param, torch.full((1024,), 10.0 + i)) for i, param in enumerate(params)])
    assert sorted(engine.keys()) == ["w0", "w1", "w2"]
    for i in range(3):
        assert same_bits(engine.wait(engine.load(f"w{i}")), torch.full((1024,), 10.0 + i))


def test_an_empty_offload_dir_is_refused_not_taken_for_the_temp_dir():
    with pytest.raises(OffloadDirError, match="empty path"):
        NvmeArena("")


def test_the_file_grows_by_what_is_needed_then_geometrically(tmp_path):
    arena = NvmeArena(str(tmp_path))
    try:
        sizes = []
        for index in range(5):
            arena.allocate(100, f"page{index}")  # one page each
            sizes.append((arena.space.file_bytes, os.fstat(arena._fd).st_size))
        assert sizes == [(4096, 4096), (8192, 8192), (16384, 16384), (16384, 16384), (32768, 32768)]
        arena.allocate(3 << 20, "big")  # needs more than the file's size: exactly that
        assert arena.space.file_bytes == 32768 + (3 << 20) - 3 * 4096
    finally:
        arena.close()


@pytest.fixture
def small_volume(tmp_path):
    """A 64 MiB tmpfs (needs root and O_DIRECT on tmpfs, Linux 6.6+)."""
    import subprocess

    volume = tmp_path / "volume"
    volume.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small volume needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(volume)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield str(volume)
    finally:
        subprocess.run(["umount", str(volume)], check=True)


def test_a_small_volume_is_filled_before_disk_full_is_raised(small_volume, monkeypatch):
    try:
        arena = NvmeArena(small_volume)
    except OffloadDirError as error:
        pytest.skip(f"no O_DIRECT on tmpfs here: {error}")
    engine = TransferEngine(offload_dir=small_volume)
    try:
        tensor = torch.arange(int(4.3 * (1 << 20)) // 4, dtype=torch.float32)  # 4.3 MiB
        engine.wait(engine.store("step", tensor, NVME, WEIGHT))
        assert same_bits(engine.wait(engine.load("step")), tensor)
        assert engine.arena.space.file_bytes == 4509696  # 4.3 MiB in whole pages, not a 256 MiB step
        engine.close()
        # With the free space unknown, the arena tries to double, fails, and falls
        # back to exactly what it needs, until the volume is full.
        monkeypatch.setattr(arena.space, "_free_bytes", lambda: None)
        slots = 0
        with pytest.raises(DiskFullError) as caught:
            while True:
                arena.allocate(1 << 20, f"slot{slots}")
                slots += 1
        assert slots >= 60  # of the 64 MiB volume's 1 MiB slots
        message = str(caught.value)
        assert f"in {arena.path}: 1048576 bytes needed" in message and "bytes free" in message
        assert_names(caught.value, f"slot{slots}", arena.file_path)
    finally:
        engine.close()
        arena.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
def test_a_private_dir_swapped_for_another_users_is_refused_and_left_alone(tmp_path, monkeypatch):
    make_dir = os.mkdir
    swapped = []

    def mkdir_then_swap(path, mode=0o777, **kwargs):
        make_dir(path, mode, **kwargs)
        if os.path.basename(path).startswith("slc-offload-"):
            os.chown(path, 12345, 12345)  # what a racing user's own directory looks like
            swapped.append(path)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    with pytest.raises(OffloadDirError, match="belongs to uid 12345, not to this user"):
        NvmeArena(str(tmp_path))
    monkeypatch.undo()
    assert len(swapped) == 1
    info = os.lstat(swapped[0])
    assert info.st_uid == 12345 and stat.S_IMODE(info.st_mode) == 0o700  # neither chmod-ed nor removed
    assert os.listdir(swapped[0]) == []


def test_a_private_dir_swapped_for_a_link_is_refused(tmp_path, monkeypatch):
    decoy = tmp_path / "decoy"
    decoy.mkdir(mode=0o755)
    base = tmp_path / "base"
    base.mkdir()
    make_dir = os.mkdir

    def mkdir_then_link(path, mode=0o777, **kwargs):
        if os.path.basename(path).startswith("slc-offload-"):
            os.symlink(decoy, path)
        else:
            make_dir(path, mode, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir_then_link)
    with pytest.raises(OffloadDirError, match="replaced, perhaps by a link"):
        NvmeArena(str(base))
    monkeypatch.undo()
    assert os.listdir(decoy) == [] and stat.S_IMODE(os.lstat(decoy).st_mode) == 0o755


@pytest.mark.parametrize("mode, warned", [(0o777, True), (0o1777, False), (0o755, False)])
def test_an_offload_dir_others_may_rename_in_is_used_with_a_warning_naming_it(tmp_path, caplog, mode, warned):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)  # chmod: mkdir's mode is masked by the umask
    below = shared / "mine"  # made by the arena, mode 0700, but movable with its parent's entries
    for offload_dir in (shared, below):
        caplog.clear()
        with caplog.at_level("WARNING", logger="slcompile.runtime.storage.offload_dirs"):
            arena = NvmeArena(str(offload_dir))
            arena.close()
        messages = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
        if not warned:
            assert messages == []
            continue
        assert len(messages) == 1
        assert messages[0].startswith(f"offload directory {offload_dir}: {shared} is writable by every user and "
                                      "has no sticky bit (mode 0777), so another user can move the private "
                                      "directory made there away")
        assert f"chmod +t {shared}" in messages[0]


def test_unfinished_private_dirs_are_removed_only_when_old_and_unlocked(tmp_path):
    import time

    from slcompile.runtime import clean_stale_dirs

    old, fresh, live, foreign = (tmp_path / name for name in (
        "slc-offload-11-0123abcd.new", "slc-offload-12-0123abcd.new", "slc-offload-13-0123abcd", "other"))
    for directory in (old, fresh, live, foreign):
        directory.mkdir(mode=0o700)
        (directory / "lock").write_text("")
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))  # killed between making its directory and naming it
    held = os.open(live / "lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a live arena (of any process, any namespace)
    try:
        assert clean_stale_dirs(str(tmp_path)) == [str(old)]
    finally:
        os.close(held)
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in (fresh, live, foreign))
    assert clean_stale_dirs(str(tmp_path)) == [str(live)]  # its lock is free now



@pytest.mark.parametrize("where", ["first chunk", "last chunk"])
def test_flipped_bits_in_a_stored_tensor_raise_corrupt_data_naming_key_file_and_offset(engine, where):
    values = torch.randn(3 << 18)  # 3 MiB: three 1 MiB chunks, each with its own checksum
    engine.wait(engine.store("blk1.fc.weight", values, NVME, WEIGHT))
    path, offset, nbytes = engine.nvme_location("blk1.fc.weight")
    assert nbytes == values.numel() * 4 and path == engine.arena.file_path
    chunk = 0 if where == "first chunk" else 2
    flip_bits(path, offset + chunk * (1 << 20) + 3)  # an exponent bit of the first float there
    with pytest.raises(CorruptDataError, match="corrupt data") as caught:
        engine.wait(engine.load("blk1.fc.weight"))
    assert_names(caught.value, "blk1.fc.weight", path)
    assert caught.value.offset == offset + chunk * (1 << 20)
    assert f"file offset {caught.value.offset}" in str(caught.value)
    # Writing it again heals it: the new slot's checksums are the new bytes'.
    engine.wait(engine.store("blk1.fc.weight", values, NVME, WEIGHT))
    assert same_bits(engine.wait(engine.load("blk1.fc.weight")), values)


def test_untouched_data_reads_back_exactly_with_checksums(engine):
    tensors = {f"t{i}": torch.randn(n) for i, n in enumerate((1, 1000, 1 << 18, (1 << 18) + 5))}
    for key, values in tensors.items():
        engine.wait(engine.store(key, values, NVME, WEIGHT))
    assert engine.arena.checksums
    for key, values in tensors.items():
        assert same_bits(engine.wait(engine.load(key)), values), key


def test_renamed_key_is_the_one_a_corrupt_read_names(engine):
    engine.wait(engine.store("w~update", torch.randn(1000), NVME, WEIGHT))
    engine.rename("w~update", "w")
    path, offset, _ = engine.nvme_location("w")
    flip_bits(path, offset)
    with pytest.raises(CorruptDataError) as caught:
        engine.wait(engine.load("w"))
    assert_names(caught.value, "w", path)


@pytest.mark.parametrize("switch", ["argument", "environment"])
def test_checksums_can_be_turned_off(tmp_path, monkeypatch, switch):
    if switch == "environment":
        monkeypatch.setenv("SLC_CHECKSUMS", "0")
        engine = TransferEngine(offload_dir=str(tmp_path))
    else:
        engine = TransferEngine(offload_dir=str(tmp_path), checksums=False)
    try:
        values = torch.ones(1000)
        engine.wait(engine.store("w", values, NVME, WEIGHT))
        assert not engine.arena.checksums
        path, offset, _ = engine.nvme_location("w")
        flip_bits(path, offset + 3)  # 1.0 -> 4.0 ** 32: used silently without checksums
        loaded = engine.wait(engine.load("w"))
        assert loaded[0].item() != 1.0 and torch.equal(loaded[1:], values[1:])
    finally:
        engine.close()


def test_transfers_after_the_arena_closed_say_so_and_touch_no_other_file(tmp_path):
    """A store or load that reaches a closed arena (`engine.arena.close()`, an engine
    collected at exit under a thread still storing) is refused before any system call:
    the arena's descriptor numbers are free by then, and the next files opened get them."""
    engine = TransferEngine(offload_dir=str(tmp_path))
    others = []
    try:
        engine.wait(engine.store("small", torch.ones(10), NVME, WEIGHT))  # one chunk
        engine.wait(engine.store("large", torch.ones(1 << 19), NVME, WEIGHT))  # several chunks
        arena = engine.arena
        arena.close()
        others = [os.open(tmp_path / f"other{index}", os.O_RDWR | os.O_CREAT, 0o600) for index in range(4)]
        for key, size in (("again", 10), ("larger", 1 << 19)):
            with pytest.raises(ArenaClosedError, match="^the nvme arena is closed") as caught:
                engine.wait(engine.store(key, torch.ones(size), NVME, WEIGHT))
            assert_names(caught.value, key, arena.file_path)
        for key in ("small", "large"):
            with pytest.raises(ArenaClosedError, match="^the nvme arena is closed") as caught:
                engine.wait(engine.load(key))
            assert_names(caught.value, key, arena.file_path)
        assert [os.fstat(fd).st_size for fd in others] == [0] * len(others)
        with pytest.raises(ArenaClosedError, match="^the nvme arena is closed"):
            arena.allocate(4096, "direct")
    finally:
        for fd in others:
            os.close(fd)
        engine.close()


def test_a_load_of_a_key_the_engine_forgot_when_it_closed_says_so(tmp_path):
    engine = TransferEngine(offload_dir=str(tmp_path))
    engine.wait(engine.store("w", torch.ones(10), NVME, WEIGHT))
    engine.close()
    with pytest.raises(UnknownKeyError, match="the engine was closed since it was stored"):
        engine.load("w")
    with pytest.raises(UnknownKeyError, match="^nothing is stored under this key; tensor key 'never'"):
        engine.load("never")
