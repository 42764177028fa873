"""Measuring: the machine (`machine`, its card in `card`, predictions in `costmodel`), the stand-in models
(`standins`), step clocks fitted to them (`clocks`), op counts (`counting`), the studies the
chapters run (`sweep`, `cachebytes`, `load_study`) and the statistics that judge them (`stats`).
It may import anything below it; nothing below imports it."""
