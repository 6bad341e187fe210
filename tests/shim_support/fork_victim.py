import sys, os, mmap, hashlib
mode, path = sys.argv[1], sys.argv[2]

def say(*parts):
    # One write(2) per line: lines shorter than PIPE_BUF from a parent and its children
    # sharing a pipe never interleave, whereas print() may write a line in pieces.
    os.write(1, (" ".join(map(str, parts)) + "\n").encode())

def check_pages(m, plain, page=4096):
    """Every page of the mapping against the file's bytes: (differing, of them zeros)."""
    differ = zeros = 0
    for start in range(0, len(m), page):
        got = m[start:start + page]
        if got != plain[start:start + page]:
            differ += 1
            if got.count(0) == len(got):
                zeros += 1
    return differ, zeros

def quarters(n):
    q = n // 4
    return [(i * q, n if i == 3 else (i + 1) * q) for i in range(4)]

def hashes(buf):
    return " ".join(hashlib.sha256(buf[a:b]).hexdigest()[:16] for a, b in quarters(len(buf)))

if mode == "plain":
    say("plain", hashes(open(path, "rb").read()))
    sys.exit(0)

f = open(path, "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
a, b = quarters(len(m))[0]
hashlib.sha256(m[a:b]).digest()  # the parent touches the first quarter only

if mode == "fork":
    pid = os.fork()
    if pid == 0:
        say("child sees", hashes(m))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    say("child status", status)
    say("parent", hashes(m))
elif mode == "pool":
    import multiprocessing as mp
    def work(part):
        a, b = part
        return hashlib.sha256(m[a:b]).hexdigest()[:16]
    with mp.get_context("fork").Pool(3) as pool:
        say("pool", " ".join(pool.map(work, quarters(len(m)))))
    say("parent", hashes(m))
elif mode == "exec":
    hashes(m)
    pid = os.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", sys.argv[3], "plain", path])
    _, status = os.waitpid(pid, 0)
    say("child status", status)
    say("parent", hashes(m))
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
    say("readers", " ".join(digests))
    say("whole", hashlib.sha256(open(path, "rb").read()).hexdigest()[:16])
elif mode == "remap":
    # A child moves (mremap) a mapping it inherited served: refused with EINVAL, as in
    # the program, and every page still reads the file's bytes, in the child and, after
    # it, in the parent. Once unmapped, the range is the child's to remap.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                            ctypes.c_int, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    failed = ctypes.c_void_p(-1).value
    size = os.fstat(f.fileno()).st_size
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    assert addr not in (None, failed), ctypes.get_errno()
    class Raw:
        def __init__(self, at):
            self.at = at
        def __len__(self):
            return size
        def __getitem__(self, s):
            a, b = s.start, min(s.stop, size)
            return ctypes.string_at(self.at + a, b - a)
    m = Raw(addr)
    a, b = quarters(size)[0]
    hashlib.sha256(m[a:b]).digest()
    plain = open(path, "rb").read()
    pid = os.fork()
    if pid == 0:
        MAYMOVE, FIXED = 1, 2
        target = libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        moved = libc.mremap(addr, size, size, MAYMOVE | FIXED, target)
        say("child move", "refused" if moved == failed else "moved",
            ctypes.get_errno() if moved == failed else 0)
        if moved != failed:
            # Read where it went (what a program that moved it does).
            addr = moved
            m = Raw(moved)
        grown = libc.mremap(addr, size, 2 * size, MAYMOVE, None)
        say("child grow", "refused" if grown == failed else "moved",
            ctypes.get_errno() if grown == failed else 0)
        differ, zeros = check_pages(m, plain)
        say("child pages differ", differ, "zeros", zeros)
        # Unmapped, the range is no longer served: an anonymous mapping put there
        # moves as any other.
        libc.munmap(addr, size)
        anon = libc.mmap(addr, 1 << 20, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)
        again = libc.mremap(anon, 1 << 20, 1 << 20, MAYMOVE | FIXED, target)
        say("child after unmap", "refused" if again == failed else "moved")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    say("child status", status)
    differ, zeros = check_pages(m, plain)
    say("parent pages differ", differ, "zeros", zeros)
elif mode == "rawfork":
    # A child made by the fork system call itself: no fork handler runs in it or in
    # the parent (as for _Fork or a raw clone), and the kernel's fork event still
    # hands the pager its userfaultfd.
    import ctypes, platform
    sys_fork = {"x86_64": 57}.get(platform.machine())
    assert sys_fork is not None, platform.machine()
    libc = ctypes.CDLL(None, use_errno=True)
    plain = open(path, "rb").read()
    pid = libc.syscall(sys_fork)
    assert pid >= 0, ctypes.get_errno()
    if pid == 0:
        differ, zeros = check_pages(m, plain)
        say("child pages differ", differ, "zeros", zeros)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    say("child status", status)
    differ, zeros = check_pages(m, plain)
    say("parent pages differ", differ, "zeros", zeros)
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
        differ, zeros = check_pages(m, plain, page)
        say("outlived", "parent-gone" if gone else "parent-alive", hashes(m))
        say("pages", (len(m) + page - 1) // page, "differ", differ, "zeros", zeros)
        os._exit(0)
    say("parent exits")
    sys.exit(0)
elif mode == "orphan-grandchild":
    # A child forks a grandchild and exits; the parent then calls os._exit. The
    # grandchild, the only one left, reads every page once the parent is gone.
    import signal, time
    plain = open(path, "rb").read()
    gone_r, gone_w = os.pipe()  # EOF once the parent is gone
    forked_r, forked_w = os.pipe()  # a byte once the grandchild exists
    if os.fork() == 0:
        os.close(gone_w)
        os.close(forked_r)
        if os.fork() == 0:
            os.close(forked_w)
            signal.alarm(90)
            os.read(gone_r, 1)
            differ, zeros = check_pages(m, plain)
            say("orphaned parent-gone", hashes(m))
            say("pages", (len(m) + 4095) // 4096, "differ", differ, "zeros", zeros)
            os._exit(0)
        os.write(forked_w, b"g")
        os._exit(0)
    os.close(gone_r)
    os.close(forked_w)
    os.read(forked_r, 1)
    # The grandchild's fork returned in the child once the service had read its event;
    # the service hands its userfaultfd to the keeper a moment later (a fork in a child
    # does not wait for that, unlike the program's own).
    time.sleep(0.2)
    say("parent forks and ends")
    os._exit(0)
elif mode in ("orphan-exit", "orphan-kill", "orphan-exec", "orphan-sibling"):
    # The parent ends without its exit handlers: os._exit, SIGKILL (by itself, or by a
    # sibling while a reader reads), or an exec of another program. The children read
    # every page afterwards (and, with a sibling, while it happens).
    import signal, time
    parent = os.getpid()
    plain = open(path, "rb").read()
    page = 4096
    pages = (len(m) + page - 1) // page

    def parent_gone():
        if os.getppid() != parent:
            return True
        try:
            with open("/proc/%d/comm" % parent) as comm:
                return not comm.read().startswith("python")
        except OSError:
            return True

    def read_after_parent(label):
        # A page never answered ends the child (SIGALRM's default action) rather than
        # the test waiting for good.
        signal.alarm(90)
        deadline = time.time() + 60
        while not parent_gone() and time.time() < deadline:
            time.sleep(0.01)
        gone = parent_gone()
        differ, zeros = check_pages(m, plain, page)
        say(label, "parent-gone" if gone else "parent-alive", hashes(m))
        say("pages", pages, "differ", differ, "zeros", zeros)

    if mode == "orphan-sibling":
        reader = os.fork()
        if reader == 0:
            signal.alarm(90)
            # Reads all of it twice, the first pass started while the parent serves.
            total_differ = total_zeros = 0
            for _ in range(2):
                differ, zeros = check_pages(m, plain, page)
                total_differ += differ
                total_zeros += zeros
            read_after_parent("orphaned")
            say("reader passes differ", total_differ, "zeros", total_zeros)
            os._exit(0)
        killer = os.fork()
        if killer == 0:
            time.sleep(0.3)
            os.kill(parent, signal.SIGKILL)
            os._exit(0)
        # Keeps reading (faulting, evicting) until killed.
        say("parent reads until killed")
        while True:
            hashes(m)
    say("parent forks and ends")
    pid = os.fork()
    if pid == 0:
        read_after_parent("orphaned")
        os._exit(0)
    # The end follows fork's return at once: the child was forked moments before.
    if mode == "orphan-exit":
        os._exit(0)
    elif mode == "orphan-kill":
        os.kill(parent, signal.SIGKILL)
    else:
        os.execv("/bin/sleep", ["sleep", "3"])
