"""Who is served when the fleet is saturated: ``inferlb bench fair`` (tenants' shares with ext_proc's fair
queue and without), ``overload`` (130% of capacity in three classes, with shedding and without) and
``hogs`` (one-sentence requests while every worker holds the largest ones)."""
