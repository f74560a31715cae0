"""ECDSA P-256 signing in the standard library alone, for the runner inside an image.

An image guarantees a Python, not ``cryptography``: the runner signs its
verdict with this. Nonces are deterministic (RFC 6979, HMAC-SHA256), so no
random source inside a container is trusted; signatures are DER, the keys'
IDs the SHA-256 of their DER SubjectPublicKeyInfo, exactly as
:mod:`vllm_hotfix.trust.signing` makes and checks them. Only signing lives here:
verifying is done outside the image, with ``cryptography``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from ...errors import UnusableKey

# NIST P-256 (secp256r1).
P = 0xFFFFFFFF00000001000000000000000000000000FFFFFFFFFFFFFFFFFFFFFFFF
A = P - 3
B = 0x5AC635D8AA3A93E7B3EBBD55769886BC651D06B0CC53B0F63BCE3C3E27D2604B
N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
G = (0x6B17D1F2E12C4247F8BCE6E563A440F277037D812DEB33A0F4A13945D898C296,
     0x4FE342E2FE1A7F9B8EE7EB4A7C0F9E162BCE33576B315ECECBB6406837BF51F5)

OID_EC_PUBLIC_KEY = bytes.fromhex("2a8648ce3d0201")  # 1.2.840.10045.2.1
OID_P256 = bytes.fromhex("2a8648ce3d030107")  # 1.2.840.10045.3.1.7

# The same names vllm_hotfix.trust.signing uses, so that its open_envelope accepts what this signs.
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "urn:vllm-hotfix:smoke-report:v1"


Point = tuple[int, int] | None  # None: the point at infinity


def _add(p1: Point, p2: Point) -> Point:
    if p1 is None:
        return p2
    if p2 is None:
        return p1
    x1, y1 = p1
    x2, y2 = p2
    if x1 == x2:
        if (y1 + y2) % P == 0:
            return None
        lam = (3 * x1 * x1 + A) * pow(2 * y1, -1, P) % P
    else:
        lam = (y2 - y1) * pow(x2 - x1, -1, P) % P
    x3 = (lam * lam - x1 - x2) % P
    return x3, (lam * (x1 - x3) - y1) % P


def multiply(k: int, point: Point = G) -> Point:
    """k * point, by double-and-add (the runner signs once per run: speed does not matter here)."""
    out: Point = None
    addend = point
    while k:
        if k & 1:
            out = _add(out, addend)
        addend = _add(addend, addend)
        k >>= 1
    return out


def _bits2int(data: bytes) -> int:
    value = int.from_bytes(data, "big")
    excess = len(data) * 8 - N.bit_length()
    return value >> excess if excess > 0 else value


def nonce(secret: int, digest: bytes) -> int:
    """RFC 6979 section 3.2 with HMAC-SHA256."""
    size = (N.bit_length() + 7) // 8
    x = secret.to_bytes(size, "big")
    h = (_bits2int(digest) % N).to_bytes(size, "big")
    v, k = b"\x01" * 32, b"\x00" * 32
    k = hmac.new(k, v + b"\x00" + x + h, hashlib.sha256).digest()
    v = hmac.new(k, v, hashlib.sha256).digest()
    k = hmac.new(k, v + b"\x01" + x + h, hashlib.sha256).digest()
    v = hmac.new(k, v, hashlib.sha256).digest()
    while True:
        v = hmac.new(k, v, hashlib.sha256).digest()
        candidate = _bits2int(v)
        if 1 <= candidate < N:
            return candidate
        k = hmac.new(k, v + b"\x00", hashlib.sha256).digest()
        v = hmac.new(k, v, hashlib.sha256).digest()


def sign_digest(secret: int, digest: bytes) -> tuple[int, int]:
    """(r, s) of a SHA-256 ``digest``."""
    e = _bits2int(digest) % N
    k = nonce(secret, digest)
    while True:
        point = multiply(k)
        assert point is not None
        r = point[0] % N
        s = pow(k, -1, N) * (e + r * secret) % N
        if r and s:
            return r, s
        k = (k + 1) % N or 1  # practically unreachable; keeps the loop total


# --- DER, only as much as EC keys and signatures need -----------------------------------------

def _der_len(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def _tlv(tag: int, body: bytes) -> bytes:
    return bytes([tag]) + _der_len(len(body)) + body


def _der_int(value: int) -> bytes:
    body = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big")  # a leading 0 keeps it positive
    return _tlv(0x02, body)


def der_signature(r: int, s: int) -> bytes:
    return _tlv(0x30, _der_int(r) + _der_int(s))


def _read(data: bytes, pos: int) -> tuple[int, bytes, int]:
    """(tag, body, position after it) of the element at ``pos``."""
    if pos + 2 > len(data):
        raise UnusableKey("truncated DER")
    tag, first = data[pos], data[pos + 1]
    pos += 2
    if first & 0x80:
        count = first & 0x7F
        if count == 0 or count > 4 or pos + count > len(data):
            raise UnusableKey("bad DER length")
        length = int.from_bytes(data[pos:pos + count], "big")
        pos += count
    else:
        length = first
    if pos + length > len(data):
        raise UnusableKey("truncated DER")
    return tag, data[pos:pos + length], pos + length


def _children(body: bytes) -> list[tuple[int, bytes]]:
    out, pos = [], 0
    while pos < len(body):
        tag, inner, pos = _read(body, pos)
        out.append((tag, inner))
    return out


def _sec1(der: bytes, curve_known: bool) -> int:
    """The secret of an RFC 5915 ECPrivateKey."""
    tag, body, _ = _read(der, 0)
    parts = _children(body) if tag == 0x30 else []
    if len(parts) < 2 or parts[0] != (0x02, b"\x01") or parts[1][0] != 0x04:
        raise UnusableKey("not an EC private key")
    params = [inner for t, inner in parts[2:] if t == 0xA0]
    if params:
        oid = _children(params[0])
        if not oid or oid[0] != (0x06, OID_P256):
            raise UnusableKey("not an ECDSA P-256 key")
    elif not curve_known:
        raise UnusableKey("the key names no curve")
    secret = int.from_bytes(parts[1][1], "big")
    if not 1 <= secret < N:
        raise UnusableKey("the key's secret is out of range")
    return secret


def load_private(pem: bytes) -> int:
    """The secret scalar of a PEM ECDSA P-256 key: PKCS#8 ``PRIVATE KEY`` or SEC1 ``EC PRIVATE KEY``."""
    text = pem.decode("ascii", "replace")
    for label in ("PRIVATE KEY", "EC PRIVATE KEY", "ENCRYPTED PRIVATE KEY"):
        begin, end = f"-----BEGIN {label}-----", f"-----END {label}-----"
        if begin not in text:
            continue
        if label == "ENCRYPTED PRIVATE KEY":
            raise UnusableKey("the key is encrypted: give the runner an unencrypted PEM key")
        body = text.split(begin, 1)[1].split(end, 1)[0]
        try:
            der = base64.b64decode("".join(body.split()), validate=True)
        except (binascii.Error, ValueError):
            raise UnusableKey("the PEM body is not base64") from None
        if label == "EC PRIVATE KEY":
            return _sec1(der, curve_known=False)
        tag, outer, _ = _read(der, 0)
        parts = _children(outer) if tag == 0x30 else []
        if len(parts) < 3 or parts[0] != (0x02, b"\x00") or parts[2][0] != 0x04:
            raise UnusableKey("not a PKCS#8 private key")
        algorithm = _children(parts[1][1])
        if algorithm[:1] != [(0x06, OID_EC_PUBLIC_KEY)] or algorithm[1:2] != [(0x06, OID_P256)]:
            raise UnusableKey("not an ECDSA P-256 key")
        return _sec1(parts[2][1], curve_known=True)
    raise UnusableKey("not a PEM private key")


def public_der(secret: int) -> bytes:
    """The DER SubjectPublicKeyInfo of the key (uncompressed point)."""
    point = multiply(secret)
    assert point is not None
    raw = b"\x04" + point[0].to_bytes(32, "big") + point[1].to_bytes(32, "big")
    algorithm = _tlv(0x30, _tlv(0x06, OID_EC_PUBLIC_KEY) + _tlv(0x06, OID_P256))
    return _tlv(0x30, algorithm + _tlv(0x03, b"\x00" + raw))


def key_id(secret: int) -> str:
    return hashlib.sha256(public_der(secret)).hexdigest()


def pae(payload_type: str, payload: bytes) -> bytes:
    kind = payload_type.encode()
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def statement(subjects: Mapping[str, str], predicate: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": digest.removeprefix("sha256:")}}
                    for name, digest in subjects.items()],
        "predicateType": PREDICATE_TYPE,
        "predicate": dict(predicate),
    }


def sign_envelope(doc: Mapping[str, Any], secret: int) -> bytes:
    """The DSSE envelope of ``doc``, laid out byte for byte as vllm_hotfix.trust.signing.sign lays it out."""
    payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    r, s = sign_digest(secret, hashlib.sha256(pae(PAYLOAD_TYPE, payload)).digest())
    envelope = {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": [{"keyid": key_id(secret), "sig": base64.b64encode(der_signature(r, s)).decode()}],
    }
    return json.dumps(envelope, indent=2).encode() + b"\n"
