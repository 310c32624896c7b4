"""The WAN comparison: every method over emulated, rate-limited links, with the bytes that cross them counted."""
