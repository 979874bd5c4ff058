"""store/storage.py on a local directory and on a real S3 API (moto's server, s3fs)."""

from __future__ import annotations

import os

import pytest

from unickpt.errors import ConfigError, IncompleteCheckpointError, UnsupportedError
from unickpt.store.storage import FsspecStorage, LocalStorage, coalesce, is_url, open_storage


def test_coalesce_groups_neighbours_and_keeps_order() -> None:
    ranges = [(100, 10), (0, 10), (5 << 20, 4), (12, 8)]
    reqs = coalesce(ranges, gap=80, most=1 << 30)
    assert reqs == [(0, 110, [1, 3, 0]), (5 << 20, (5 << 20) + 4, [2])]
    assert coalesce(ranges, gap=79, most=1 << 30)[0] == (0, 20, [1, 3])
    # A request never grows past `most` (a single larger range is still one request).
    assert coalesce([(0, 10), (10, 10), (20, 100)], gap=0, most=20) == [(0, 20, [0, 1]), (20, 120, [2])]


def test_is_url() -> None:
    assert is_url("s3://b/x") and is_url("memory://x") and not is_url("/x") and not is_url("file:///x")


def test_open_storage_local_and_file_url(tmp_path) -> None:
    st, root = open_storage(f"file://{tmp_path}")
    assert isinstance(st, LocalStorage) and root == str(tmp_path)
    with pytest.raises(ConfigError, match="storage_options are for fsspec URLs"):
        open_storage(tmp_path, {"anon": True})


def test_missing_backend_names_the_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed: no missing backend to report")
    with pytest.raises(UnsupportedError, match=r"no file system for gs:// .*pip install 'unickpt\[gcs\]'"):
        open_storage("gs://bucket/run")


def _roundtrip(st, root) -> None:
    p = st.join(root, "a.bin")
    f = st.open_write(p)
    data = os.urandom(3 << 20)
    f.write(data[: 1 << 20])
    f.write(data[1 << 20 :])
    f.close()
    h = st.open_read(p)
    assert h.size == len(data)
    assert h.pread(5, 7) == data[5:12]
    got = h.pread_many([(10, 5), (0, 3), (2 << 20, 100), (len(data) - 1, 1)])
    assert got == [data[10:15], data[0:3], data[2 << 20 : (2 << 20) + 100], data[-1:]]
    with pytest.raises(IncompleteCheckpointError, match="truncated"):
        h.pread(len(data) - 2, 4)
    h.close()
    assert st.put(st.join(root, "COMMIT"), b"1", exclusive=True) is True
    assert st.put(st.join(root, "COMMIT"), b"2", exclusive=True) is False
    assert st.read_bytes(st.join(root, "COMMIT")) == b"1"
    assert st.listdir(root) == ["COMMIT", "a.bin"]
    st.remove([p, st.join(root, "missing")])
    assert st.listdir(root) == ["COMMIT"]
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        st.open_read(p)
    # An aborted write leaves nothing behind.
    g = st.open_write(st.join(root, "b.bin"))
    g.write(b"x" * 10)
    st.abort(g)
    assert st.listdir(root) == ["COMMIT"]


def test_local_storage(tmp_path) -> None:
    st, root = open_storage(tmp_path)
    _roundtrip(st, root)


def test_s3_storage_roundtrip_and_ranged_reads(s3) -> None:
    st, root = open_storage(f"s3://{s3.bucket}/run", s3.storage_options("t"))
    assert isinstance(st, FsspecStorage) and st.exclusive_put
    _roundtrip(st, root)


def test_s3_reads_only_the_wanted_bytes(s3) -> None:
    st, root = open_storage(f"s3://{s3.bucket}/run", s3.storage_options("reader"))
    data = os.urandom(8 << 20)
    st.put(st.join(root, "big.bin"), data)
    s3.reset()
    h = st.open_read(st.join(root, "big.bin"))
    wanted = [(i << 20, 4096) for i in range(0, 8, 2)]  # far apart: one request each
    assert h.pread_many(wanted) == [data[o : o + n] for o, n in wanted]
    assert s3.served("GET", "reader") == 4 * 4096
    s3.reset()
    near = [(i * 8192, 4096) for i in range(16)]  # gaps below COALESCE_GAP: one request
    assert h.pread_many(near) == [data[o : o + n] for o, n in near]
    assert s3.requests[("GET", "reader")] == 1
    assert s3.served("GET", "reader") == 15 * 8192 + 4096


def test_environment_endpoint_is_honoured(s3) -> None:
    # No storage_options: AWS_ENDPOINT_URL and the key variables come from the environment.
    st, root = open_storage(f"s3://{s3.bucket}/env")
    st.put(st.join(root, "x"), b"abc")
    assert st.read_bytes(st.join(root, "x")) == b"abc"
