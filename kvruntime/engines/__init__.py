"""What moves a request, chosen once at connect (choice): a direct NIXL READ, the
same-node engine and its gathers, the staging pools (staged), coalesced READs."""
