"""A seccomp filter for the submission's process: the system calls it never needs, refused.

Built with libseccomp (the library behind Docker's, systemd's and Chromium's filters) through
ctypes: it knows each architecture's call numbers, compiles the rules to BPF and kills a call
made through another architecture's entry (32-bit calls on x86-64), none of which is worth
writing again by hand. Its Python binding (Debian's python3-seccomp) lives in the system's
Python, not in a virtual environment, hence ctypes. Where the library is missing, `AVAILABLE`
is False and the grader says that no filter was in force.

Refused with EPERM, once the sandbox is set up: keyrings (`keyctl`, `add_key`, `request_key`:
the grader's user keyring), `ptrace`, `process_vm_*`, mounts old and new (`mount`, `umount2`,
`pivot_root`, `fsopen`, `fsmount`, `move_mount`, `open_tree`, ...), `bpf`, `perf_event_open`,
`userfaultfd`, `kexec_*`, and new namespaces: `unshare`, `setns`, and `clone` with any
`CLONE_NEW*` flag. `clone3` passes its flags in memory, which a filter cannot read, so it answers
ENOSYS: the C library then falls back to `clone`, which the filter can check.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

from autograde.sandbox import isolation

REFUSED = (
    "keyctl", "add_key", "request_key",
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "bpf", "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load",
    "unshare", "setns",
)
NEW_NAMESPACES = (isolation.CLONE_NEWNS, isolation.CLONE_NEWUTS, isolation.CLONE_NEWIPC, isolation.CLONE_NEWPID,
                  isolation.CLONE_NEWNET, isolation.CLONE_NEWUSER, isolation.CLONE_NEWCGROUP)
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7


def SCMP_ACT_ERRNO(number: int) -> int:  # noqa: N802  (libseccomp's name)
    return 0x00050000 | (number & 0xFFFF)


class _ArgumentTest(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _load_library() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        library = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_init.argtypes = [ctypes.c_uint32]
    library.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    library.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(_ArgumentTest)]
    library.seccomp_load.argtypes = [ctypes.c_void_p]
    library.seccomp_release.argtypes = [ctypes.c_void_p]
    return library


# Loaded in the fork server, before any private root hides the library's folder.
_seccomp = _load_library()
AVAILABLE = _seccomp is not None


class FilterError(OSError):
    pass


def _rule(context, action: int, name: str, tests: list[_ArgumentTest] = ()) -> None:
    number = _seccomp.seccomp_syscall_resolve_name(name.encode())
    if number < 0:  # not a call of this architecture (umount on aarch64, say)
        return
    array = (_ArgumentTest * len(tests))(*tests) if tests else None
    result = _seccomp.seccomp_rule_add_array(context, action, number, len(tests), array)
    if result < 0:
        raise FilterError(-result, f"seccomp rule for {name}: {errno.errorcode.get(-result, result)}")


def install() -> None:
    """Refuse the calls above in this process and every process it starts, for good.

    Needs `no_new_privs` (set by the caller) or CAP_SYS_ADMIN; raises FilterError if it cannot."""
    if _seccomp is None:
        raise FilterError(errno.ENOSYS, "libseccomp is not installed")
    context = _seccomp.seccomp_init(SCMP_ACT_ALLOW)
    if not context:
        raise FilterError(errno.ENOMEM, "seccomp_init failed")
    try:
        refuse = SCMP_ACT_ERRNO(errno.EPERM)
        for name in REFUSED:
            _rule(context, refuse, name)
        for flag in NEW_NAMESPACES:  # one rule per flag: a rule's tests must all hold, and any flag is enough
            _rule(context, refuse, "clone", [_ArgumentTest(0, SCMP_CMP_MASKED_EQ, flag, flag)])
        _rule(context, SCMP_ACT_ERRNO(errno.ENOSYS), "clone3")
        result = _seccomp.seccomp_load(context)
        if result < 0:
            raise FilterError(-result, f"seccomp_load: {errno.errorcode.get(-result, result)}")
    finally:
        _seccomp.seccomp_release(context)
