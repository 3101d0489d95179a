"""kvstack's installer: builds UCX and NIXL from pinned recipes and proves the result.

Runs from a checkout (`python -m installer`); it reads recipes/ beside this package.
"""
