"""The router's own HTTP/2 for its gRPC door: the pieces of an h2c server
on the asyncio event loop, starting with HPACK (RFC 7541), the header
compression (``hpack``: ``Decoder``, ``Encoder``, ``HpackError``; its
Huffman code in ``huffman``, its static table in ``static_table``). Only the
standard library: the RFC's tables are typed in as facts.
"""
