"""peer.net.trust: whom and what to trust: signed, self-certifying progress records, authenticated runs, the offence
ledger, the checks of a reducer's average.

Modules: ``auth``, ``revocations``, ``exclusion``, ``records``, ``progress``, ``span_checks``.
"""
