"""Jobs that depend on jobs, and who hears of them: `depends_on` resolution and settling, the notification
outbox and its webhook sender, and which sweep members admission may take. May import core, spec, policy, config,
store and tenancy."""
