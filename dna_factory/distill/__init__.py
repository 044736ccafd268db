"""On-policy distillation (``python distill.py``): the stage (``stage.py``), the trainers
(``trainers.py``), the teacher behind a vLLM server (``teacher_server.py``) and the student/teacher
tokenizer check (``tokenizer_alignment.py``). See docs/distillation.md.
"""
