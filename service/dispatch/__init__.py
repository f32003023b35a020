"""The dispatcher: its loop (`dispatcher`) and its phases: admission, submission of attempts, finishing
ended attempts, late logs, node watching, stall watching, and shunter's own effects on its host (`host_files`,
`host_effects`). May import every folder below it, backends included; nothing imports it but the wiring
(`service.runtime`) and the estimate."""
