"""The threshold sweep: variants and server commands, managed servers, the load client, the bench stage."""
