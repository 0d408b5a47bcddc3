#!/usr/bin/python3
"""Independent reference decoder for lgreco's `.lgc` files.

Written from docs/FORMAT.md alone, without looking at lgreco's sources, as an
independent check that the documentation is enough to decode the format. It
uses only the Python 3 standard library.

Usage: lgc_decode.py [--as-element-type] IN.lgc OUT.f32

Reads IN.lgc, performs every validation FORMAT.md asks of a reader, decodes
the payload (codecs `none`, `quant`, `topk` and `powersgd`) and writes the values to OUT.f32 as
raw little-endian float32. Exit status 0 on success; on any problem one line
`lgc_decode.py: error: <what is wrong>` goes to stderr and the exit status is 1.

--as-element-type: for a `quant` layer whose element type is float16 or
bfloat16, round each decoded float32 value to that type (nearest even, NaN
becomes 0x7FFF, as FORMAT.md describes for float16/bfloat16 output) and then
widen it back to float32 for writing. Without it the float32 result of the
decoding formula is written as is. (FORMAT.md does not say which of the two
`lgreco-codec decode` writes for such a layer.)
"""

import math
import struct
import sys

PROG = "lgc_decode.py"

MAGIC = b"\x89LGC\r\n\x1a\n"
VERSION = 1
FIXED_HEADER = 64            # bytes before the spec
MAX_SPEC_LEN = 1024
MAX_COUNT = 2 ** 34

ELEMENT_TYPES = {0: ("float32", 4), 1: ("float16", 2), 2: ("bfloat16", 2)}

QUANT_DEFAULTS = {"bits": 4, "bucket": 1024, "rounding": "stochastic"}


class LgcError(Exception):
    """A problem with the input file (or the command line)."""


# --------------------------------------------------------------------------
# CRC-32C (Castagnoli), reflected polynomial 0x82F63B78, init/xorout 0xFFFFFFFF

def _make_crc_table(poly=0x82F63B78):
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _make_crc_table()


def crc32c(data):
    """CRC-32C of a bytes-like object."""
    table = _CRC_TABLE
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc_self_check():
    got = crc32c(b"123456789")
    if got != 0xE3069283:
        raise LgcError("CRC-32C self-check failed: CRC-32C('123456789') = "
                       "0x%08X, expected 0xE3069283" % got)


# --------------------------------------------------------------------------
# Exact float32 arithmetic on Python floats (binary64)

_F32 = struct.Struct("<f")


def f32_bytes(x):
    """x rounded to nearest-even float32, as 4 little-endian bytes.

    The C cast inside struct.pack rounds correctly; CPython raises
    OverflowError when a finite x rounds to infinity, so produce the infinity.
    NaN is packed as whatever quiet NaN the cast gives (0x7FC00000 for the
    default NaN; any quiet NaN is accepted by the tests)."""
    try:
        return _F32.pack(x)
    except OverflowError:
        return _F32.pack(math.copysign(math.inf, x))


def f32(x):
    """x rounded to nearest-even float32 (returned as a Python float).

    A sum, difference, product or quotient of two float32 values computed in
    binary64 and then rounded to binary32 is the correctly rounded float32
    result (binary64 has more than 2*24+2 bits), so f32(a op b) is exact
    float32 arithmetic."""
    return _F32.unpack(f32_bytes(x))[0]


# --------------------------------------------------------------------------
# float16 / bfloat16 <-> float32 bit conversions

def _small_float_layout(name):
    """(mantissa bits, exponent bits) of float16 or bfloat16."""
    return (10, 5) if name == "float16" else (7, 8)


def small_to_f32_bits(h, name):
    """Widen float16/bfloat16 bits h exactly to float32 bits.

    NaNs keep sign and payload (shifted into the top of the float32
    mantissa); no quieting is done, FORMAT.md does not ask for any."""
    if name == "bfloat16":
        return h << 16
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if exp == 0x1F:                       # inf / NaN
        return sign | 0x7F800000 | (mant << 13)
    if exp == 0:
        if mant == 0:                     # +-0
            return sign
        # subnormal: value = mant * 2^-24; normalize
        shift = 11 - mant.bit_length()    # bring the leading 1 to bit 10
        mant <<= shift
        exp = 1 - shift
        mant &= 0x3FF
    return sign | ((exp - 15 + 127) << 23) | (mant << 13)


def f32_to_small_bits(u, name):
    """Round float32 bits u to nearest-even float16/bfloat16 bits.

    NaN becomes 0x7FFF (FORMAT.md, "as CUDA's conversions do")."""
    mbits, ebits = _small_float_layout(name)
    bias = (1 << (ebits - 1)) - 1
    emax_field = (1 << ebits) - 1
    sign = (u >> 16) & 0x8000
    exp = (u >> 23) & 0xFF
    mant = u & 0x7FFFFF
    if exp == 0xFF:
        return 0x7FFF if mant else sign | (emax_field << mbits)
    if exp == 0 and mant == 0:
        return sign
    # exact value = m * 2^e with an integer m
    m, e = (mant, -149) if exp == 0 else (mant | 0x800000, exp - 150)
    top = e + m.bit_length() - 1                    # unbiased exponent
    qe = max(top, 1 - bias) - mbits                 # exponent of one ulp
    shift = qe - e
    if shift <= 0:
        q = m << -shift
    else:
        q = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and q & 1):
            q += 1
    if q >> (mbits + 1):                            # mantissa overflowed
        q >>= 1
        qe += 1
    if q >> mbits == 0:                             # subnormal (or zero)
        return sign | q
    field = qe + mbits + bias
    if field >= emax_field:
        return sign | (emax_field << mbits)         # rounds to infinity
    return sign | (field << mbits) | (q & ((1 << mbits) - 1))


# --------------------------------------------------------------------------
# Codec specs

def _parse_uint(spec, key, text):
    """A decimal value of a numeric key. FORMAT.md does not define the value
    syntax; only plain ASCII decimal digits are accepted."""
    if not text or not all("0" <= ch <= "9" for ch in text):
        raise LgcError("codec spec %r: option %r: value %r is not a decimal "
                       "number" % (spec, key, text))
    return int(text)


def parse_spec(spec):
    """Parse a codec spec into (family, options dict with defaults filled).

    Accepts any key order (FORMAT.md: "Keys may appear in any order"), i.e.
    also a spec that is not in canonical form."""
    if spec == "":
        raise LgcError("codec spec is empty")
    if not all(0x21 <= ord(ch) <= 0x7E for ch in spec):
        raise LgcError("codec spec %r contains a space, control or non-ASCII "
                       "character" % spec)
    family, colon, rest = spec.partition(":")
    if family not in ("none", "quant", "topk", "powersgd"):
        raise LgcError("codec spec %r: unknown family %r" % (spec, family))
    if family == "topk":
        return family, _parse_topk_options(spec, rest if colon else None)
    if family == "powersgd":
        return family, _parse_powersgd_options(spec, rest if colon else None)
    if not colon:
        return family, (dict(QUANT_DEFAULTS) if family == "quant" else {})
    options = {}
    for option in rest.split(","):
        key, eq, value = option.partition("=")
        if not eq or not key or not value:
            raise LgcError("codec spec %r: malformed option %r (expected "
                           "key=value)" % (spec, option))
        if family == "none" or key not in QUANT_DEFAULTS:
            raise LgcError("codec spec %r: unknown key %r for family %r"
                           % (spec, key, family))
        if key in options:
            raise LgcError("codec spec %r: repeated key %r" % (spec, key))
        options[key] = value
    return family, _check_quant_options(spec, options)


def _parse_density(spec, text):
    """A density as an integer number of parts per billion: digits, optionally
    a point and 1..9 more digits, in (0, 1]."""
    whole, point, fraction = text.partition(".")
    digits = lambda t: t != "" and all("0" <= ch <= "9" for ch in t)
    if not digits(whole) or (point and not digits(fraction)) or len(fraction) > 9:
        raise LgcError("codec spec %r: density=%s is not a decimal with at most "
                       "9 digits after the point" % (spec, text))
    ppb = int(whole) * 10 ** 9 + int((fraction or "0").ljust(9, "0"))
    if not 0 < ppb <= 10 ** 9:
        raise LgcError("codec spec %r: density=%s is not in (0, 1]" % (spec, text))
    return ppb


def _parse_topk_options(spec, rest):
    opts = {"density_ppb": 10 ** 7}
    if rest is None:
        return opts
    seen = set()
    for option in rest.split(","):
        key, eq, value = option.partition("=")
        if not eq or not key or not value:
            raise LgcError("codec spec %r: malformed option %r (expected "
                           "key=value)" % (spec, option))
        if key != "density":
            raise LgcError("codec spec %r: unknown key %r for family 'topk'"
                           % (spec, key))
        if key in seen:
            raise LgcError("codec spec %r: repeated key %r" % (spec, key))
        seen.add(key)
        opts["density_ppb"] = _parse_density(spec, value)
    return opts


def _parse_powersgd_options(spec, rest):
    opts = {"rank": 4, "rows": 0}
    if rest is None:
        return opts
    seen = set()
    for option in rest.split(","):
        key, eq, value = option.partition("=")
        if not eq or not key or not value:
            raise LgcError("codec spec %r: malformed option %r (expected "
                           "key=value)" % (spec, option))
        if key not in opts:
            raise LgcError("codec spec %r: unknown key %r for family "
                           "'powersgd'" % (spec, key))
        if key in seen:
            raise LgcError("codec spec %r: repeated key %r" % (spec, key))
        seen.add(key)
        opts[key] = _parse_uint(spec, key, value)
    if not 1 <= opts["rank"] <= 256:
        raise LgcError("codec spec %r: rank=%d out of range 1..256"
                       % (spec, opts["rank"]))
    return opts


def powersgd_shape(spec, opts, n):
    """(rows, cols) of the matrix view; a file's spec must name its rows."""
    rows = opts["rows"]
    if rows == 0 or n % rows:
        raise LgcError("codec spec %r: %d values are not a matrix of %d rows"
                       % (spec, n, rows))
    return rows, n // rows


def topk_k(n, ppb):
    """k = ceil(n * d / 10^9), in integers."""
    return -(-(n * ppb) // 10 ** 9)


def _check_quant_options(spec, raw):
    opts = dict(QUANT_DEFAULTS)
    if "bits" in raw:
        bits = _parse_uint(spec, "bits", raw["bits"])
        if not 1 <= bits <= 8:
            raise LgcError("codec spec %r: bits=%s out of range 1..8"
                           % (spec, raw["bits"]))
        opts["bits"] = bits
    if "bucket" in raw:
        bucket = _parse_uint(spec, "bucket", raw["bucket"])
        if not (32 <= bucket <= 1048576 and bucket % 32 == 0):
            raise LgcError("codec spec %r: bucket=%s is not a multiple of 32 "
                           "in 32..1048576" % (spec, raw["bucket"]))
        opts["bucket"] = bucket
    if "rounding" in raw:
        if raw["rounding"] not in ("stochastic", "nearest"):
            raise LgcError("codec spec %r: rounding=%s is not stochastic or "
                           "nearest" % (spec, raw["rounding"]))
        opts["rounding"] = raw["rounding"]
    return opts


def payload_size(family, opts, n, elem_size):
    """The codec's payload size in bytes for n values."""
    if family == "none":
        return n * elem_size
    if family == "topk":
        return 8 * topk_k(n, opts["density_ppb"])
    if family == "powersgd":
        rows, cols = powersgd_shape("powersgd", opts, n)
        return 4 * (rows + cols) * opts["rank"]
    bits, bucket = opts["bits"], opts["bucket"]
    return 8 * -(-n // bucket) + 4 * bits * -(-n // 32)


# --------------------------------------------------------------------------
# The .lgc header

def header_size(spec_len):
    """H = ceil((64 + S + 8) / 8) * 8."""
    return -(-(FIXED_HEADER + spec_len + 8) // 8) * 8


def parse_file(data):
    """Validate the whole file; return (header dict, payload bytes)."""
    if len(data) < FIXED_HEADER:
        raise LgcError("file too short: %d bytes, a header needs at least %d"
                       % (len(data), FIXED_HEADER))
    if data[0:8] != MAGIC:
        raise LgcError("wrong magic %s: not an .lgc file" % data[0:8].hex())
    (version, hsize, count, psize, seed, step, rank, layer, etype,
     slen) = struct.unpack_from("<IIQQQQIIII", data, 8)
    if version != VERSION:
        raise LgcError("unsupported format version %d (expected %d)"
                       % (version, VERSION))
    if slen > MAX_SPEC_LEN:
        raise LgcError("spec length %d exceeds the maximum of %d"
                       % (slen, MAX_SPEC_LEN))
    if hsize != header_size(slen):
        raise LgcError("header size %d does not match spec length %d "
                       "(expected %d)" % (hsize, slen, header_size(slen)))
    if len(data) < hsize:
        raise LgcError("file truncated: %d bytes, shorter than the %d-byte "
                       "header" % (len(data), hsize))
    stored_hcrc, = struct.unpack_from("<I", data, hsize - 4)
    hcrc = crc32c(data[0:hsize - 4])
    if hcrc != stored_hcrc:
        raise LgcError("header checksum mismatch: stored 0x%08X, computed "
                       "0x%08X" % (stored_hcrc, hcrc))
    try:
        spec = data[FIXED_HEADER:FIXED_HEADER + slen].decode("ascii")
    except UnicodeDecodeError:
        raise LgcError("codec spec is not ASCII: %r"
                       % data[FIXED_HEADER:FIXED_HEADER + slen]) from None
    family, opts = parse_spec(spec)
    if etype not in ELEMENT_TYPES:
        raise LgcError("unknown element type %d" % etype)
    if count > MAX_COUNT:
        raise LgcError("element count %d exceeds 2^34" % count)
    expected = payload_size(family, opts, count, ELEMENT_TYPES[etype][1])
    if psize != expected:
        raise LgcError("payload size %d does not match codec %r for %d "
                       "values (expected %d)" % (psize, spec, count, expected))
    if len(data) != hsize + psize:
        raise LgcError("file is %d bytes, %s than header + payload = %d"
                       % (len(data),
                          "shorter" if len(data) < hsize + psize else "longer",
                          hsize + psize))
    payload = data[hsize:]
    stored_pcrc, = struct.unpack_from("<I", data, hsize - 8)
    pcrc = crc32c(payload)
    if pcrc != stored_pcrc:
        raise LgcError("payload checksum mismatch: stored 0x%08X, computed "
                       "0x%08X" % (stored_pcrc, pcrc))
    header = dict(version=version, header_size=hsize, count=count,
                  payload_size=psize, seed=seed, step=step, rank=rank,
                  layer=layer, element_type=ELEMENT_TYPES[etype][0],
                  spec=spec, family=family, options=opts)
    return header, payload


# --------------------------------------------------------------------------
# Payload decoders; each returns the float32 output as bytes

def decode_none(payload, n, elem_name):
    if elem_name == "float32":
        return bytes(payload)                       # bit exact copy
    out = bytearray(4 * n)
    if elem_name == "bfloat16":                     # upper half of an f32
        out[2::4] = payload[0::2]
        out[3::4] = payload[1::2]
        return bytes(out)
    # float16: exact widening through a 65536-entry table of f32 bytes
    table = [struct.pack("<I", small_to_f32_bits(h, "float16"))
             for h in range(65536)]
    halves = struct.unpack("<%dH" % n, payload)
    return b"".join(map(table.__getitem__, halves))


def _spread_table():
    """SPREAD[byte] puts bit k of byte at bit 8k (one byte per lane)."""
    table = []
    for byte in range(256):
        v = 0
        for k in range(8):
            if byte >> k & 1:
                v |= 1 << (8 * k)
        table.append(v)
    return table


_SPREAD = _spread_table()


def group_codes(words):
    """The 32 codes of one group from its b bit-plane words, as 32 bytes
    (lane l at index l). Each lane's code is assembled in its own byte of
    a 256-bit integer; codes are < 256 so lanes never carry into each other."""
    sp = _SPREAD
    acc = 0
    for j, w in enumerate(words):
        lanes = (sp[w & 0xFF] | sp[w >> 8 & 0xFF] << 64
                 | sp[w >> 16 & 0xFF] << 128 | sp[w >> 24] << 192)
        acc |= lanes << j
    return acc.to_bytes(32, "little")


def bucket_value_fn(vmin, unit):
    """code -> f32 bytes of min + f32(code) * unit, memoized per bucket.

    float32 multiply, then float32 add, each rounded to nearest even, no FMA.
    A bucket whose min or unit is not finite decodes to the float32 NaN
    0x7FFFFFFF for every element (FORMAT.md, "Non-finite buckets")."""
    if not (math.isfinite(vmin) and math.isfinite(unit)):
        nan = struct.pack("<I", 0x7FFFFFFF)
        return lambda code: nan
    cache = {}

    def value(code):
        out = cache.get(code)
        if out is None:
            out = f32_bytes(f32(float(code) * unit) + vmin)
            cache[code] = out
        return out
    return value


def decode_quant(payload, n, bits, bucket):
    nb = -(-n // bucket)
    ng = -(-n // 32)
    meta = struct.unpack_from("<%df" % (2 * nb), payload, 0)
    words = struct.unpack_from("<%dI" % (bits * ng), payload, 8 * nb)
    pieces = []
    value = None
    for g in range(ng):
        first = 32 * g
        k, first_in_bucket = divmod(first, bucket)
        if first_in_bucket == 0:                    # a new bucket starts here
            value = bucket_value_fn(meta[2 * k], meta[2 * k + 1])
        codes = group_codes(words[g * bits:(g + 1) * bits])
        lanes = min(32, n - first)                  # ignore lanes past the end
        pieces.append(b"".join(map(value, codes[:lanes])))
    return b"".join(pieces)


def decode_topk(payload, n, ppb):
    """Zeros except value j at index j; indices must increase and stay below n."""
    k = topk_k(n, ppb)
    indices = struct.unpack_from("<%dI" % k, payload, 0)
    out = bytearray(4 * n)                          # +0.0 everywhere
    previous = -1
    for j, index in enumerate(indices):
        if index >= n or index <= previous:
            raise LgcError("topk payload: index %d at position %d is %s"
                           % (index, j, "not below the count %d" % n
                              if index >= n else "not above the one before"))
        previous = index
        out[4 * index:4 * index + 4] = payload[4 * k + 4 * j:4 * k + 4 * j + 4]
    return bytes(out)


def decode_powersgd(payload, n, rank, rows):
    """M[i][j] = sum over c of P[i][c] * Q[j][c]: float32 products (exact in
    binary64) summed in binary64 in order of c, rounded once to float32."""
    cols = n // rows
    p = struct.unpack_from("<%df" % (rows * rank), payload, 0)
    q = struct.unpack_from("<%df" % (cols * rank), payload, 4 * rows * rank)
    out = []
    nan = struct.pack("<I", 0x7FFFFFFF)
    for i in range(rows):
        pi = p[i * rank:(i + 1) * rank]
        for j in range(cols):
            qj = q[j * rank:(j + 1) * rank]
            v = 0.0
            for c in range(rank):
                v += pi[c] * qj[c]
            out.append(nan if math.isnan(v) else f32_bytes(v))
    return b"".join(out)


def round_to_element_type(f32_data, elem_name):
    """Round float32 values to float16/bfloat16 and widen back (see
    --as-element-type)."""
    n = len(f32_data) // 4
    vals = struct.unpack("<%dI" % n, f32_data)
    out = [small_to_f32_bits(f32_to_small_bits(u, elem_name), elem_name)
           for u in vals]
    return struct.pack("<%dI" % n, *out)


def decode(data, as_element_type=False):
    header, payload = parse_file(data)
    n = header["count"]
    elem = header["element_type"]
    if header["family"] == "none":
        return decode_none(payload, n, elem)
    if header["family"] == "topk":
        return decode_topk(payload, n, header["options"]["density_ppb"])
    if header["family"] == "powersgd":
        return decode_powersgd(payload, n, header["options"]["rank"],
                               header["options"]["rows"])
    out = decode_quant(payload, n, header["options"]["bits"],
                       header["options"]["bucket"])
    if as_element_type and elem != "float32":
        out = round_to_element_type(out, elem)
    return out


# --------------------------------------------------------------------------

def main(argv):
    args = argv[1:]
    as_element_type = "--as-element-type" in args
    args = [a for a in args if a != "--as-element-type"]
    if len(args) != 2:
        raise LgcError("usage: %s [--as-element-type] IN.lgc OUT.f32" % PROG)
    crc_self_check()
    try:
        with open(args[0], "rb") as f:
            data = f.read()
    except OSError as e:
        raise LgcError("cannot read %s: %s" % (args[0], e.strerror or e))
    out = decode(data, as_element_type)
    try:
        with open(args[1], "wb") as f:
            f.write(out)
    except OSError as e:
        raise LgcError("cannot write %s: %s" % (args[1], e.strerror or e))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except LgcError as e:
        print("%s: error: %s" % (PROG, e), file=sys.stderr)
        sys.exit(1)
    except Exception as e:              # never a traceback on a bad file
        print("%s: error: internal error: %s: %s"
              % (PROG, type(e).__name__, e), file=sys.stderr)
        sys.exit(1)
