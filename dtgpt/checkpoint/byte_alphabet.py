"""GPT-2's byte-level alphabet: how a byte-level BPE's tokenizer.json spells bytes as characters."""


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, as character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take characters 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table
