"""A chat template shaped like Qwen3.6's, for the router tests (the tiny model's own is plain ChatML).

Written for these tests, not copied: what matters is what the Qwen3.5/3.6 templates do with the
fields the router hands over. Tools go into the system turn as JSON with the XML call format;
an assistant turn's `tool_calls` render as `<tool_call><function=...><parameter=...>` from the
decoded `arguments` object (`|items`: a string would fail to render); `tool` messages go into a
user turn as `<tool_response>` blocks; `reasoning_content` of a past turn is not replayed; the
generation prompt opens `<think>` unless `enable_thinking` is false (then an empty block).
"""

QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, answer with\\n<tool_call>\\n<function=NAME>\\n' }}"
    "{{- '<parameter=NAME>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set function = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n<function=' + function.name + '>\\n' }}"
    "{%- for name, value in (function.arguments or {}) | items %}"
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) }}"
    "{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
