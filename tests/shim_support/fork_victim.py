import sys, os, mmap, hashlib
mode, path = sys.argv[1], sys.argv[2]

def quarters(n):
    q = n // 4
    return [(i * q, n if i == 3 else (i + 1) * q) for i in range(4)]

def hashes(buf):
    return " ".join(hashlib.sha256(buf[a:b]).hexdigest()[:16] for a, b in quarters(len(buf)))

if mode == "plain":
    print("plain", hashes(open(path, "rb").read()), flush=True)
    sys.exit(0)

f = open(path, "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
a, b = quarters(len(m))[0]
hashlib.sha256(m[a:b]).digest()  # the parent touches the first quarter only

if mode == "fork":
    pid = os.fork()
    if pid == 0:
        print("child sees", hashes(m), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child status", status, flush=True)
    print("parent", hashes(m), flush=True)
elif mode == "pool":
    import multiprocessing as mp
    def work(part):
        a, b = part
        return hashlib.sha256(m[a:b]).hexdigest()[:16]
    with mp.get_context("fork").Pool(3) as pool:
        print("pool", " ".join(pool.map(work, quarters(len(m)))), flush=True)
    print("parent", hashes(m), flush=True)
elif mode == "exec":
    hashes(m)
    pid = os.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", sys.argv[3], "plain", path])
    _, status = os.waitpid(pid, 0)
    print("child status", status, flush=True)
    print("parent", hashes(m), flush=True)
elif mode == "readers":
    import multiprocessing as mp
    n = int(sys.argv[3])
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n)
    piece = 4 << 20
    def read_all(_):
        h = hashlib.sha256()
        for start in range(0, len(m), piece):
            h.update(m[start:start + piece])
            barrier.wait()
        return h.hexdigest()[:16]
    procs = []
    out = ctx.Queue()
    for i in range(n):
        p = ctx.Process(target=lambda q=out: q.put(read_all(0)))
        p.start()
        procs.append(p)
    digests = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    print("readers", " ".join(digests), flush=True)
    print("whole", hashlib.sha256(open(path, "rb").read()).hexdigest()[:16], flush=True)
elif mode in ("outlive", "outlive-raw"):
    import time
    if mode == "outlive-raw":
        # A mapping nothing unmaps, not even the interpreter's finalization (which
        # unmaps `m`): libc's mmap, through ctypes.
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
        size = os.fstat(f.fileno()).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        class Raw:
            def __len__(self):
                return size
            def __getitem__(self, s):
                a, b = s.start, min(s.stop, size)
                return ctypes.string_at(addr + a, b - a)
        m = Raw()
        a, b = quarters(size)[0]
        hashlib.sha256(m[a:b]).digest()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        # Read nothing until the parent is gone (reparented: its files, the pager's
        # userfaultfds among them, were closed before that).
        deadline = time.time() + 60
        while os.getppid() == parent and time.time() < deadline:
            time.sleep(0.05)
        gone = os.getppid() != parent
        plain = open(path, "rb").read()
        page = 4096
        differ = zeros = 0
        for start in range(0, len(m), page):
            got = m[start:start + page]
            if got != plain[start:start + page]:
                differ += 1
                if got.count(0) == len(got):
                    zeros += 1
        print("outlived", "parent-gone" if gone else "parent-alive", hashes(m), flush=True)
        print("pages", (len(m) + page - 1) // page, "differ", differ, "zeros", zeros, flush=True)
        os._exit(0)
    print("parent exits", flush=True)
    sys.exit(0)
