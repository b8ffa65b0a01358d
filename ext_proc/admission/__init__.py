"""The door: the fair queue's order, its asyncio gate, and the rules for room and waits."""
