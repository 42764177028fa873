"""Measuring instruments: the machine (`machine`, its card in `card`, predictions in `costmodel`), the
stand-in models (`standins`), step clocks fitted to them (`clocks`), op counts (`counting`) and the
statistics that judge a sampler against its noise floor (`stats`). The chapters' experiments that
use them live in `lib.book.studies`. It may import anything below it; nothing below imports it."""
