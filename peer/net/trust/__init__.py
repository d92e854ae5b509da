"""peer.net.trust: whom and what to trust: signed, self-certifying progress records, authenticated runs, the offence
ledger, the checks of a reducer's average, and the signed spans that make two versions of one a proof.

Modules: ``auth``, ``revocations``, ``exclusion``, ``records``, ``progress``, ``span_checks``, ``span_proofs``.
"""
