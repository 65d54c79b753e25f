"""Dettmers' signed dynamic maps of the ``d8`` / ``d4`` first-moment formats (private to ``flatopt.adafactor8bit.quant``).

Construction (bitsandbytes / adafactor8bit 0.4.6): with T total bits and E exponent bits (d8: 8/7, d4: 4/3), for
i = 0 … E − 1 take the midpoints of 2^(i + T − 1 − E) + 1 float32 points evenly spaced on [0.1, 1] and add
±10^(i − (E − 1))·midpoint; then 0 and 1; sorted.
"""

from __future__ import annotations

import functools

import numpy as np

_F32 = np.float32


def _linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in float32 (forward from start for the first half, backward from end for the rest)."""
    s, e = _F32(start), _F32(end)
    step = (e - s) / _F32(steps - 1)
    i = np.arange(steps)
    half = steps // 2
    return np.where(i < half, s + step * i.astype(np.float32), e - step * (steps - 1 - i).astype(np.float32))


# The d8 map exactly as the original builds it: its torch.linspace (vectorised float32 CPU kernel) cannot be
# reproduced with NumPy to the last ulp for 33+ points, so the 256 float32 entries are stored (little-endian hex);
# tests/test_codec.py rebuilds them with the construction below and checks them against the original's map.
_D8_HEX = (
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf000053bf"
    "66664fbfcdcc4bbf333348bf9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbfcdcc27bf343324bf"
    "9a9920bf00001dbf666619bfcdcc15bf343312bf9a990ebf00000bbf666607bfcccc03bf333300bf3233f9be0000f2becccceabe"
    "9a99e3be6666dcbe3333d5be0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabecccca2be9a999bbe666694be34338dbe"
    "000086be99997dbe33336fbecdcc60be666652be000044be9a9935be333327becdcc18be66660abe0000f8bd3433dbbd85ebc9bd"
    "f728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd2a5ca7bd9a99a1bd0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd"
    "5d8f72bd3d0a67bd1f855bbd000050bde17a44bdc3f538bda3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc"
    "9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc643b1fbc180416bccdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb"
    "0d02abbb749398bbdd2486bb8a6c67bb5c8f42bb2db21dbbfca9f1ba9defa7baff6577ba3ee859ba806a3cbac1ec1eba016f01ba"
    "83e2c7b905e78cb90bd723b94b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6b7a313b500000000b7a31335941a5a36"
    "ff0502370642b23734803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a806a3c3a3ee8593aff65773a"
    "9defa73afca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b6abcf43b8195033c"
    "cdcc0c3c1804163c643b1f3c48e13a3cc3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d6766163d"
    "85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d5d8f723d7b147e3dcdcc843d5d8f8a3deb51903d7b14963d"
    "0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d0000f83d66660a3ecdcc183e"
    "3333273e9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e6666943e9a999b3ecccca23e0000aa3e"
    "3333b13e6666b83e9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33eccccea3e0000f23e3233f93e3333003fcccc033f"
    "6666073f00000b3f9a990e3f3433123fcdcc153f6666193f00001d3f9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f"
    "3433363fcdcc393f66663d3f0000413f9a99443f3333483fcdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f"
    "0000653f9a99683f33336c3fcdcc6f3f6666733f0000773f9a997a3f33337e3f0000803f"
)


@functools.lru_cache(maxsize=None)
def dynamic_map(total_bits: int) -> np.ndarray:
    """Dettmers' signed dynamic map (d8: 8 bits, 7 exponent bits; d4: 4 bits, 3 exponent bits), sorted."""
    if total_bits == 8:
        return np.frombuffer(bytes.fromhex("".join(_D8_HEX)), "<f4").astype(np.float32)
    return construct_dynamic_map(total_bits)


def construct_dynamic_map(total_bits: int) -> np.ndarray:
    """The construction (linspace midpoints, scaled by powers of ten); exact for d4, within 1 ulp for d8."""
    ebits = 7 if total_bits == 8 else 3
    nsb = total_bits - 1
    data = []
    for i in range(ebits):
        b = _linspace_f32(0.1, 1.0, 2 ** (i + nsb - ebits) + 1)
        means = ((b[:-1] + b[1:]) / _F32(2.0)).astype(np.float32)
        f = 10.0 ** (-(ebits - 1) + i)
        data += [float(_F32(f) * x) for x in means] + [float(_F32(-f) * x) for x in means]
    data += [0.0, 1.0]
    return np.array(sorted(data), np.float32)
