# Victim of tests/shim_inherit_share.rs, run by `hyperoffload run --inherit`: child
# processes started with subprocess (fork+exec) map one model file.
#
# `two FILE OUT`: two children each hash the whole mapping 4 MiB at a time, in step
# (after each piece each waits for the other through a pipe); prints each child's
# `hash ROLE HEX`. Then copies the stats files of the run (beside
# HYPEROFFLOAD_STATS) into OUT.
# `outlive FILE OUT HOW`: a host child maps the file and reads its first quarter; a
# guest child then maps it and reads one page; the host ends (HOW: `exit`, or `kill`:
# SIGKILL to itself); once it is reaped the guest compares every page of the mapping
# with the file read by read(2) and prints `pages N differ D zeros Z`.
# `part FILE OUT OFFSET LEN`: a host child maps the whole file and touches it; a guest
# child then maps LEN bytes from OFFSET (part of the host's region) and hashes them;
# then the host hashes the whole mapping. Prints `hash slice HEX` and `hash whole HEX`.
import glob, hashlib, mmap, os, shutil, signal, subprocess, sys

PIECE = 4 << 20
PAGE = mmap.PAGESIZE


def say(*parts):
    # One write(2) per line: lines shorter than PIPE_BUF from processes sharing a pipe
    # never interleave, whereas print() may write a line in pieces.
    os.write(1, (' '.join(map(str, parts)) + '\n').encode())


def mapping(path):
    f = open(path, 'rb')
    return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)


def reader(path, role, rfd, wfd):
    m = mapping(path)
    h = hashlib.sha256()
    for off in range(0, len(m), PIECE):
        h.update(m[off:off + PIECE])
        os.write(wfd, b'x')
        os.read(rfd, 1)
    say('hash', role, h.hexdigest())


def host(path, how):
    m = mapping(path)
    q = len(m) // 4
    for off in range(0, q, PAGE):
        m[off]
    os.write(1, b'host ready\n')
    sys.stdin.readline()
    if how == 'kill':
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)


def guest(path, wfd, rfd):
    m = mapping(path)
    m[len(m) // 2]
    os.write(wfd, b'a')
    os.read(rfd, 1)
    want = open(path, 'rb').read()
    differ = zeros = 0
    zero = bytes(PAGE)
    for off in range(0, len(m), PAGE):
        got = m[off:off + PAGE]
        if got != want[off:off + PAGE]:
            differ += 1
            if got == zero[:len(got)]:
                zeros += 1
    say('pages', (len(m) + PAGE - 1) // PAGE, 'differ', differ, 'zeros', zeros)


def copy_stats(out):
    stats = os.environ.get('HYPEROFFLOAD_STATS')
    if stats:
        for path in glob.glob(stats + '*'):
            shutil.copy(path, out)


def me(*args):
    return [sys.executable, __file__, *args]


def whole(path):
    m = mapping(path)
    m[0]
    os.write(1, b'mapped\n')
    sys.stdin.readline()
    say('hash whole', hashlib.sha256(m[:]).hexdigest())


def part(path, offset, length):
    f = open(path, 'rb')
    m = mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ, offset=offset)
    h = hashlib.sha256()
    for off in range(0, len(m), PIECE):
        h.update(m[off:off + PIECE])
    say('hash slice', h.hexdigest())


mode = sys.argv[1]
if mode == 'whole':
    whole(sys.argv[2])
elif mode == 'slice':
    part(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif mode == 'part':
    path, out, offset, length = sys.argv[2:6]
    h = subprocess.Popen(me('whole', path), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert h.stdout.readline() == b'mapped\n'
    g = subprocess.Popen(me('slice', path, offset, length))
    say('slice status', g.wait())
    h.stdin.write(b'go\n')
    h.stdin.close()
    os.write(1, h.stdout.read())
    say('whole status', h.wait())
    copy_stats(out)
elif mode == 'reader':
    reader(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
elif mode == 'host':
    host(sys.argv[2], sys.argv[3])
elif mode == 'guest':
    guest(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif mode == 'two':
    path, out = sys.argv[2], sys.argv[3]
    a_r, b_w = os.pipe()
    b_r, a_w = os.pipe()
    first = subprocess.Popen(me('reader', path, 'a', str(a_r), str(a_w)), pass_fds=(a_r, a_w))
    second = subprocess.Popen(me('reader', path, 'b', str(b_r), str(b_w)), pass_fds=(b_r, b_w))
    codes = [first.wait(), second.wait()]
    say('status', *codes)
    copy_stats(out)
elif mode == 'outlive':
    path, out, how = sys.argv[2], sys.argv[3], sys.argv[4]
    h = subprocess.Popen(me('host', path, how), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert h.stdout.readline() == b'host ready\n'
    g_r, d_w = os.pipe()
    d_r, g_w = os.pipe()
    g = subprocess.Popen(me('guest', path, str(g_w), str(g_r)), pass_fds=(g_r, g_w))
    os.read(d_r, 1)
    h.stdin.write(b'go\n')
    h.stdin.close()
    say('host status', h.wait())
    os.write(d_w, b'g')
    say('guest status', g.wait())
    copy_stats(out)
