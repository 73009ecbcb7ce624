"""The fp8 forward's V^T scratch: V (B, H, S, D) copied transposed, (B, H, D, S'), for the Gluon
fp8 kernel, whose P V product reads its B operand K-major only (fp8 wgmma).

`vt_kernel` is a byte copy through one [keys, D] tile a program: rows of V in (any strides), rows
of V^T out (contiguous along the keys). With KEY_PERM the keys of each block of 32 are written
in the order the kernel's P fragment holds them (`fwd_gluon._p_operand`): position
a = 16h + 4t + 2j + e holds key c = 16h + 8j + 2t + e, and the keys past S up to the next
multiple of 32 are zeros (the masked P = 0 then meets a finite V). torch's strided copy of the
same permutation moved 330 GB/s (406 us at B=4 H=16 S=8192 D=128, 15% of the fp8 call; the
twenty-third session's profile, docs/performance.md attempt 95).
"""

import triton
import triton.language as tl

from ..launch import cache as launch_cache
from ..launch.args import cdiv


@triton.jit
def vt_kernel(Src, Dst, nheads, seqlen, head_dim, n_keys_out,
              stride_sb, stride_sh, stride_ss, stride_sd, stride_db, stride_dh, stride_dd,
              KEY_PERM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # one flat grid (a (B * H) grid axis would stop at 65535): keys fastest, then D, then (b, h)
    pid = tl.program_id(0)
    n_s = tl.cdiv(n_keys_out, BLOCK_S)
    n_d = tl.cdiv(head_dim, BLOCK_D)
    pid_s = pid % n_s
    pid_d = (pid // n_s) % n_d
    bh = pid // (n_s * n_d)
    b = (bh // nheads).to(tl.int64)
    h = (bh % nheads).to(tl.int64)
    a = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # key position in V^T
    c = a  # the key of V it holds
    if KEY_PERM:  # within blocks of 32 keys (fwd_gluon.KEY_PERM_BLOCK: the e4m3 k32 A fragment)
        w = a % 32
        c = a - w + 16 * (w // 16) + 8 * ((w // 2) % 2) + 2 * ((w // 4) % 4) + w % 2
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    x = tl.load(Src + b * stride_sb + h * stride_sh + c[:, None].to(tl.int64) * stride_ss + d[None, :] * stride_sd,
                mask=(c < seqlen)[:, None] & d_ok[None, :], other=0)
    tl.store(Dst + b * stride_db + h * stride_dh + d[:, None].to(tl.int64) * stride_dd + a[None, :], tl.trans(x),
             mask=d_ok[:, None] & (a < n_keys_out)[None, :])


BLOCK_S, BLOCK_D, NUM_WARPS = 128, 64, 4  # 128-byte rows of V^T a program


def launch_vt(src, dst, *, key_perm: bool, block_s: int = BLOCK_S, block_d: int = BLOCK_D,
              num_warps: int = NUM_WARPS) -> None:
    """dst[b, h, :, a] = src[b, h, c(a), :] (bytes: both uint8 views), c(a) = a or, with key_perm,
    the permutation within each block of 32 keys; dst's keys past src's are zeros (key_perm: dst
    holds S rounded up to 32 keys). src (B, H, S, D) any strides; dst (B, H, D, S') with unit
    stride along its keys. A call repeats the launch plan of an earlier one of the same metadata
    (launch_cache's plans: every argument but the two tensors is fixed by the key)."""
    key = None
    if launch_cache.plans_enabled(vt_kernel):
        key = (src.shape, src.stride(), dst.shape, dst.stride(), src.data_ptr() % 16 == 0,
               dst.data_ptr() % 16 == 0, src.get_device(), launch_cache.current_device(), key_perm, block_s,
               block_d, num_warps)
        planned = _PLANS.get(key)
        if planned is not None:
            planned.launch(src, dst)
            return
    batch, nheads, seqlen, head_dim = src.shape
    n_keys_out = dst.shape[3]
    if dst.stride(3) != 1:
        raise ValueError("launch_vt: dst must be contiguous along its keys")
    grid = (cdiv(n_keys_out, block_s) * cdiv(head_dim, block_d) * batch * nheads,)
    if grid[0] == 0:
        return
    tail = (nheads, seqlen, head_dim, n_keys_out, *src.stride(), *dst.stride()[:3])
    plan = launch_cache.make_plan(vt_kernel, grid, src, dst, *tail, KEY_PERM=key_perm, BLOCK_S=block_s,
                                  BLOCK_D=block_d, num_warps=num_warps)
    launch_cache.keep(_PLANS, key, plan, vt_kernel, tail)


_PLANS = launch_cache.plan_table()


def compile_spec(key_perm: bool) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of `vt_kernel` as `launch_vt` calls it, for an ahead-of-time
    compile (fmha kernels build) beside the fp8 forward's."""
    signature = {name: "i32" for name in vt_kernel.arg_names}
    signature.update(Src="*u8", Dst="*u8")
    constexprs = dict(KEY_PERM=key_perm, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D)
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs, {"num_warps": NUM_WARPS}
