"""peer.net.round: one round on the wire: matchmaking, the group's plan, a reducer's parts, the butterfly all-reduce,
two levels, and the round runner that composes them.

Modules: ``matchmaking``, ``group``, ``reduction``, ``allreduce``, ``levels``, ``round_runner``.
"""
