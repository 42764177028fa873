"""The chapters' experiments, kept beside the book and apart from the instruments in
`lib.measure`: chapter 10's k sweep (`sweep`), the trained pair's alpha on the H100 clock
(`draft_pair`, chapters 10 and 11), the one-token fast path's share of V(2) for chapters 10 and
12 (`fastpath`), chapter 7's storage sweep (`cachebytes`) and chapter 8's load study
(`load_study`)."""
