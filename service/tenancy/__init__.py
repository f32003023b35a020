"""Who asks and what they may ask: API callers and tokens (`auth`), attempt tokens, the two deployment modes
(`modes`), code archives (their files, records and proofs), and usage accounting. May import the folders below it:
core, spec, policy, config, store."""
